"""When the outbox's processes trace (workers/ground/tracing.py): off unless asked for."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigError
from workers.ground.tracing import wanted


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OUTBOX_TRACING": "otel"}, True),
        ({"OUTBOX_TRACING": "off", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ],
)
def test_tracing_is_on_only_when_asked_for(env, on):
    assert wanted(env) is on


def test_an_unknown_mode_names_the_variable():
    with pytest.raises(ConfigError, match="OUTBOX_TRACING: 'jaeger' is not a tracing mode; use otel or off"):
        wanted({"OUTBOX_TRACING": "jaeger"})
