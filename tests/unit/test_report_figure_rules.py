"""The report's attributability names a fault point (outbox/reads/report.py): a status code, or a
transport error as a worker names it. The ledger cannot import the workers' failure table, so its
list of transport errors is checked against it here."""

from __future__ import annotations

import httpx
import pytest

from outbox.reads.report import TRANSPORT_ERRORS, names_a_fault_point
from workers.provider.classify import _EXCEPTION_TABLE, classify_exception


def test_the_ledgers_transport_errors_are_the_workers():
    reasons = {reason for _, _, reason in _EXCEPTION_TABLE}
    unexpected = classify_exception(RuntimeError("boom")).reason.split(":", 1)[0]
    assert set(TRANSPORT_ERRORS) == reasons | {unexpected}


@pytest.mark.parametrize(
    ("status_code", "error", "named"),
    [
        (422, "http_422: invalid_amount", True),
        (503, None, True),
        (None, "read_timeout: timed out", True),
        (None, f"{classify_exception(httpx.ConnectError('refused')).reason}: refused", True),
        (None, "breaker open for 4.000s more", False),
        (None, "deadline passed before attempt 1 (120s): 130.0s all of it waiting for a worker (our backlog)", False),
        (None, None, False),
    ],
)
def test_a_fault_point_is_a_status_code_or_a_transport_error(status_code, error, named):
    assert names_a_fault_point(status_code, error) is named


def test_same_effect_when_names_declared_arguments_or_the_file_is_refused():
    from outbox.actions.files import ActionsFileError
    from workers.provider.actions import parse_actions
    from workers.sandbox.scenario import action, actions_doc

    def doc(report: object) -> dict[str, object]:
        refund = action("/v1/refunds", args=["order_id", "amount"], report=report)
        return actions_doc("http://127.0.0.1:9", actions={"payments.refund.create": refund})

    loaded = parse_actions(doc({"same_effect_when": ["order_id"]}))
    spec = loaded.actions["payments.refund.create"].report
    assert spec is not None and spec.same_effect_when == ["order_id"]
    for bad, said in (
        ({"same_effect_when": ["customer"]}, "not in args"),
        ({"same_effect_when": []}, "same_effect_when"),
        ({"same_effect_when": ["order-id"]}, "not an argument name"),
        ({"same_when": ["order_id"]}, "same_when"),
    ):
        with pytest.raises(ActionsFileError, match=said):
            parse_actions(doc(bad))
