"""The JSON log line (workers/ground/logs.py): fields, exceptions, and its configuration's checks."""

from __future__ import annotations

import datetime as dt
import json
import logging
import logging.config

import pytest

from outbox.errors import ConfigError
from outbox.settings import LogFormat, log_format_from
from workers.ground.logs import JsonFormatter, uvicorn_logging


def record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("workers.test")
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            import sys

            exc_info = sys.exc_info()
    return logger.makeRecord(logger.name, logging.INFO, __file__, 1, msg, args, exc_info, extra=extra)


def test_a_line_carries_the_event_and_every_extra_field():
    when = dt.datetime(2026, 12, 3, tzinfo=dt.UTC)
    line = json.loads(
        JsonFormatter().format(
            record("retry scheduled in %.1fs", 1.5, operation_id="op-1", attempt=2, fencing_token=7, at=when, ids={"a"})
        )
    )
    assert line["message"] == "retry scheduled in 1.5s" and line["level"] == "INFO" and line["logger"] == "workers.test"
    assert (line["operation_id"], line["attempt"], line["fencing_token"]) == ("op-1", 2, 7)
    assert line["at"] == when.isoformat() and line["ids"] == ["a"]
    assert line["ts"].endswith("+00:00") and "args" not in line and "msg" not in line
    assert "trace_id" not in line  # no span: no ids (and no OpenTelemetry needed)


def test_an_exception_is_one_field_on_the_same_line():
    text = JsonFormatter().format(record("cut", exc=True))
    assert "\n" not in text
    assert "RuntimeError: boom" in json.loads(text)["exc"]


def test_the_format_is_text_or_json_and_says_so_otherwise():
    assert log_format_from(None) is LogFormat.TEXT and log_format_from(" JSON ") is LogFormat.JSON
    with pytest.raises(ConfigError, match="OUTBOX_LOG_FORMAT: 'yaml' is not a log format; use text or json"):
        log_format_from("yaml")


def test_uvicorns_config_is_its_own_for_text_and_valid_for_json(monkeypatch):
    monkeypatch.delenv("OUTBOX_LOG_FORMAT", raising=False)
    assert uvicorn_logging() == {}
    monkeypatch.setenv("OUTBOX_LOG_FORMAT", "json")
    config = uvicorn_logging()["log_config"]
    names = ("uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in names}
    try:
        logging.config.dictConfig(config)  # what uvicorn does with it
        assert isinstance(logging.getLogger("uvicorn.access").handlers[0].formatter, JsonFormatter)
    finally:
        for n, (handlers, propagate) in saved.items():
            logging.getLogger(n).handlers[:] = handlers
            logging.getLogger(n).propagate = propagate
