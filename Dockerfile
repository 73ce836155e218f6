# One image for every agent-outbox process (migrate, relay, worker, reconciler, flower, sandbox).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY outbox ./outbox
COPY producer ./producer
COPY workers ./workers
COPY downstream ./downstream
COPY breaker ./breaker
COPY sandbox ./sandbox
COPY commands ./commands
COPY examples ./examples
RUN pip install --no-cache-dir '.[flower,api,mcp]'
# Celery refuses nothing as root with JSON-only serialisation, but there is no reason to be root.
RUN useradd --create-home outbox
USER outbox
