"""The sandbox's own logging: text, or one JSON object per line when ``OUTBOX_LOG_FORMAT=json``
(as the services beside it log in compose). The fake provider shares no code with the system it
fakes: a bug there must not hide the same bug here."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os

TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# What every LogRecord has; anything else on a record was attached by the code (extra=) and is written.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonLines(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        out["process"] = record.process
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: int | str) -> None:
    """The process's logging at ``level``, in ``OUTBOX_LOG_FORMAT`` (text or json; ValueError
    naming the variable otherwise)."""
    fmt = (os.environ.get("OUTBOX_LOG_FORMAT") or "text").strip().lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"OUTBOX_LOG_FORMAT must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level, handlers=[handler])
    if fmt == "json":
        logging.captureWarnings(True)
