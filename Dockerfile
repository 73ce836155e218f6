# One image for every agent-outbox process (migrate, relay, worker, reconciler, beat, api, mcp,
# metrics, flower, sandbox).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
# The whole checkout less .dockerignore: pyproject.toml decides which packages the install takes, so
# a package added or moved is in the image without an edit here (tests/integration/packaging/test_image.py
# replays this context and runs every compose command from it).
COPY . .
# Every compose service's extra; `binary`: psycopg's prebuilt implementation, as the slim image has no libpq;
# `otel`: traces, off until OUTBOX_TRACING=otel or an OTEL_* exporter variable is set.
RUN pip install --no-cache-dir '.[flower,api,mcp,sandbox,binary,otel]'
# Celery refuses nothing as root with JSON-only serialisation, but there is no reason to be root.
# A numeric USER: Kubernetes' runAsNonRoot can only verify a UID, not a name.
RUN useradd --create-home --uid 10001 outbox
USER 10001
