"""What a model is told, and what it may ask (issue 51, points 4 and 5), through a real ``agent-outbox
mcp`` process (stdio, the official SDK's client), the relay, Celery workers, PostgreSQL, Redis and the
sandbox, which counts every effect:

- a second call on purpose: ``occurrence`` makes a second refund of one order, the same occurrence
  again makes none, and a call without it keeps the key it always had;
- two words for two states: an intent still queued (nothing sent) and one the provider accepted and
  has not finished are told apart (``stage``, the sentence, the MCP Tasks status message);
- a task's own result reads "Done:", never "Already done" (which a model reads as "an earlier call did
  it"); a call that finds an earlier call's operation still reads "Already done"."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.harness import FAST_LOOKUPS, action, actions_doc, wait_for
from tests.integration.surfaces.test_mcp import _stdio
from tests.integration.surfaces.test_mcp_tasks import call_task, get_task, task_result

mcp = pytest.importorskip("mcp")
from mcp import Client  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
REFUND = "payments.refund.create"
ARGS = {"order_id": "o-81", "amount": "5.00", "currency": "EUR", "reason": "damaged"}
SCOPE = "conv-7"
# The tasks helpers (test_mcp_tasks.py) send this conversation's scope.


def _actions(pipe: Any, sandbox: Any) -> None:
    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"description": "Refund an order.", "reference_args": ["order_id"]}
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))


async def _call(client: Any, name: str, args: dict[str, Any]) -> Any:
    return await client.call_tool(name, args, meta={"agent-outbox/scope": SCOPE})


async def _settled(client: Any, operation_id: str) -> dict[str, Any]:
    done = await _call(client, "wait_operation", {"operation_id": operation_id, "timeout_s": 30})
    return dict(done.structured_content)


def test_a_second_refund_of_one_order_on_purpose_with_occurrence(pipe, sandbox):
    _actions(pipe, sandbox)
    pipe.start_worker("sender", queues="dispatch")
    pipe.start_relay()

    async def session() -> None:
        async with Client(_stdio(pipe), read_timeout_seconds=60) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "only to make another one of the same call" in tools[REFUND].description
            assert (
                "only to make another one of the same call"
                in (tools[REFUND].input_schema["properties"]["occurrence"]["description"])
            )
            first = (await _call(client, REFUND, ARGS)).structured_content
            # No occurrence: the key a call always had.
            assert first["idempotency_key"] == f'{SCOPE}:{REFUND}:ref="o-81"' and first["new"]
            assert (await _settled(client, first["operation_id"]))["outcome"] == "SUCCEEDED"

            # The model means a second partial refund of the same order: without occurrence it is the
            # first call again (no second effect); with occurrence=2 it is another call.
            again = (await _call(client, REFUND, ARGS)).structured_content
            assert again["operation_id"] == first["operation_id"] and again["new"] is False
            second = (await _call(client, REFUND, ARGS | {"occurrence": 2})).structured_content
            assert second["new"] is True and second["operation_id"] != first["operation_id"]
            assert second["idempotency_key"] == f'{SCOPE}:{REFUND}:ref="o-81":occurrence=2'
            assert (await _settled(client, second["operation_id"]))["outcome"] == "SUCCEEDED"

            # The same occurrence again (a retry of the second call, "2" as text): the same operation.
            for repeat in (2, "2"):
                same = (await _call(client, REFUND, ARGS | {"occurrence": repeat})).structured_content
                assert same["operation_id"] == second["operation_id"] and same["new"] is False
            # occurrence=1 is the first one; a bad one is refused, nothing submitted.
            one = (await _call(client, REFUND, ARGS | {"occurrence": 1})).structured_content
            assert one["operation_id"] == first["operation_id"]
            bad = await _call(client, REFUND, ARGS | {"occurrence": 0})
            assert bad.is_error and "occurrence" in bad.content[0].text

    anyio.run(session)
    refunds = sandbox.effects()
    assert len(refunds) == 2 and {e["idempotency_key"] for e in refunds} == {
        f't1:{SCOPE}:{REFUND}:ref="o-81"',
        f't1:{SCOPE}:{REFUND}:ref="o-81":occurrence=2',
    }
    assert sandbox.duplicates() == []


def test_queued_and_accepted_read_differently_and_a_tasks_own_result_reads_done(pipe, sandbox):
    _actions(pipe, sandbox)
    sandbox.configure(processing_s=300, processing_status=202)  # accepted, finished once its clock moves
    pipe.start_relay()  # no worker yet: what is submitted stays queued

    async def session() -> None:
        async with Client(_stdio(pipe), read_timeout_seconds=60, mode="legacy") as client:
            task = await call_task(client, ARGS)
            task_id = task["taskId"]
            queued = (await _call(client, "get_operation", {"operation_id": task_id})).structured_content
            assert queued["outcome"] == "PENDING" and queued["stage"] == "QUEUED"
            assert queued["model_message"].startswith("Queued, not sent yet"), queued["model_message"]
            assert "Accepted" not in queued["model_message"]
            assert (await get_task(client, task_id))["statusMessage"] == "queued: not sent yet"

            await anyio.to_thread.run_sync(lambda: pipe.start_worker("w1", extra_env=FAST_LOOKUPS))
            await anyio.to_thread.run_sync(
                lambda: wait_for(lambda: pipe.op(task_id).status == "accepted", 30, what="accepted by the provider")
            )
            accepted = (await _call(client, "get_operation", {"operation_id": task_id})).structured_content
            assert accepted["outcome"] == "PENDING" and accepted["stage"] == "ACCEPTED"
            assert accepted["model_message"].startswith("Accepted, not finished"), accepted["model_message"]
            assert accepted["model_message"] != queued["model_message"]
            assert (await get_task(client, task_id))["statusMessage"].startswith("accepted by the provider")

            await anyio.to_thread.run_sync(lambda: sandbox.advance_clock(301))  # the provider finishes it
            result = await task_result(client, task_id)  # the task's own result
            assert result.structured_content["outcome"] == "SUCCEEDED", result
            own = result.content[0].text
            assert own.startswith("Done: ") and "Already done" not in own, own
            assert result.structured_content["stage"] is None
            # The same call again finds what the task did: that one reads as an earlier call's.
            replay = await _call(client, REFUND, ARGS)
            assert replay.structured_content["operation_id"] == task_id
            assert replay.content[0].text.startswith("Already done: an earlier call"), replay.content[0].text

    anyio.run(session)
    assert len(sandbox.effects()) == 1
