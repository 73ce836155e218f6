"""How every process logs: text (the default) or, with ``OUTBOX_LOG_FORMAT=json``, one JSON object
per line that a log pipeline can index without a parser.

A JSON line carries ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message`` (the event), every
field the code passes in ``extra=`` (``operation_id``, ``tenant``, ``action``, ``attempt``,
``fencing_token``, ...), ``trace_id`` / ``span_id`` when an OpenTelemetry span is current (only if
OpenTelemetry is installed), ``process`` and ``exc`` (the formatted traceback) when there is one.
The levels mean what they mean in text: ERROR is a final failure, nothing less.

Applied where a process sets up its logging: the CLI (workers/cli/main.py), Celery workers and beat
(celery_app.py's after_setup_logger), the sandbox, and uvicorn under ``serve`` and ``mcp --http``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
from typing import Any

from outbox.errors import ConfigError
from outbox.settings import LogFormat, log_format_from

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord has: anything else on a record came from ``extra=`` (or a library's own
# attributes, e.g. uvicorn's color_message, kept: they are the caller's fields too).
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_DROPPED = frozenset({"color_message"})  # uvicorn's colored copy of the message


def _trace_ids() -> dict[str, str]:
    """The current OpenTelemetry span's ids, if OpenTelemetry is installed and a span is recording."""
    trace = sys.modules.get("opentelemetry.trace")  # imported by whoever traces; never here
    if trace is None:
        return {}
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def _plain(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in _DROPPED and key not in out:
                out[key] = _plain(value)
        out.update(_trace_ids())
        out["process"] = record.process
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def log_format() -> LogFormat:
    """OUTBOX_LOG_FORMAT (ConfigError naming it when it is neither text nor json)."""
    return log_format_from(os.environ.get("OUTBOX_LOG_FORMAT"))


def formatter(fmt: LogFormat | None = None, text: str = TEXT_FORMAT) -> logging.Formatter:
    return JsonFormatter() if (fmt or log_format()) is LogFormat.JSON else logging.Formatter(text)


def configure(level: int | str, text: str = TEXT_FORMAT) -> None:
    """A process's logging, as logging.basicConfig would set it, in OUTBOX_LOG_FORMAT. In json,
    Python's warnings are log records too (a bare warning line would break the stream)."""
    fmt = log_format()
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt, text=text))
    logging.basicConfig(level=level, handlers=[handler])
    if fmt is LogFormat.JSON:
        logging.captureWarnings(True)


def configure_early() -> None:
    """Celery's processes, as their app is made: in json, the root logger gets its JSON handler now,
    so the warnings Celery gives before it sets up logging (running as root, say) are JSON lines,
    and Celery, finding the root logger configured, adds no handler of its own. Text: nothing."""
    if log_format() is LogFormat.JSON and not logging.getLogger().handlers:
        configure(logging.WARNING)


def use_format(logger: logging.Logger) -> None:
    """Every handler of ``logger`` in OUTBOX_LOG_FORMAT, when it is json (Celery's own handlers:
    celery_app.py's after_setup_logger); text leaves a library's own format alone."""
    if log_format() is LogFormat.JSON:
        for handler in logger.handlers:
            handler.setFormatter(JsonFormatter())


def say(message: str, *, level: int = logging.INFO, logger: str = "agent_outbox", **fields: Any) -> None:
    """A line a command writes for its operator on stderr (``agent-outbox run`` starting or
    stopping, an error that ends a command): as it is in text; in json one JSON record, whatever the
    log level (it is the command's own output, not a log line it may leave out). An invalid
    OUTBOX_LOG_FORMAT: text (that is what the line may be about)."""
    try:
        fmt = log_format()
    except ConfigError:
        fmt = LogFormat.TEXT
    if fmt is LogFormat.JSON:
        record = logging.LogRecord(logger, level, __file__, 0, message, None, None)
        record.__dict__.update(fields)
        message = JsonFormatter().format(record)
    print(message, file=sys.stderr, flush=True)


def uvicorn_logging() -> dict[str, Any]:
    """uvicorn's keyword arguments for OUTBOX_LOG_FORMAT: none for text (uvicorn's own format),
    ``log_config`` with JSON lines for its server and access logs otherwise."""
    if log_format() is not LogFormat.JSON:
        return {}
    fmt = {"()": f"{__name__}.JsonFormatter"}
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "log_config": {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"json": fmt},
            "handlers": {"default": handler},
            "loggers": {name: {"handlers": ["default"], "propagate": False} for name in ("uvicorn", "uvicorn.access")}
            | {"uvicorn.error": {"propagate": True}},
        }
    }
