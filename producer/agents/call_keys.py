"""The key of a tool call: what makes two calls one operation, and what makes them two.

**The key rule.** A model may call the same tool twice (a retry after a timeout, a resumed run, a
second identical call): each must map to the same operation and answer its outcome instead of acting
again. So a tool call's idempotency key is made only of what the host owns and what survives retries:

    {scope}:{action}:ref={the declared reference arguments}     (tool.reference_args in the actions file)
    {scope}:{action}:args={sha256 of the canonical arguments}   (otherwise)

and, for a second call on purpose, ``:occurrence={n or label}`` (below).

``scope`` is the host's: a conversation, run or thread id (MCP: the ``agent-outbox/scope`` entry of the
request's ``_meta``, else the server's ``--scope``; OpenAI Agents SDK: what ``scope=`` returns from the
run context; LangGraph: the thread id). Never the tool call id (a model's retry gets a new one), never
a model-written "key" argument, never a timestamp. Limits: two calls with the same arguments in one
scope are one operation, also when a person meant two (give such actions a reference argument, e.g.
an invoice number, or pass ``occurrence``); arguments that differ only in what the model wrote freely
(a reason text) are two operations, unless the action declares reference arguments, which then decide
alone.

**A second call on purpose.** Every tool takes ``occurrence`` (an integer 1-1000 or a short label the
model chooses), never sent to the provider: ``occurrence: 2`` is another call than the same arguments
without it (a second partial refund of one order), and ``occurrence: 2`` again is that second call
again, never a third effect. Absent, or 1, is the first one: the key is exactly the one it always was
(no existing key changes). A number and its text ("2") are one occurrence.

Numbers: runtimes hand JSON numbers over as binary floats; a float is read back through its shortest
decimal repr (``12.5`` stays 12.5, exact for up to 15 significant digits). Declare money as strings in
``tool.args_schema`` to be exact beyond that.
"""

from __future__ import annotations

import hashlib
import json
import re
from decimal import Decimal
from typing import Any

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import canonical_value, dumps_canonical
from outbox.ledger.intent import MAX_KEY_LEN
from producer.agents.catalog import MAX_OCCURRENCE, OCCURRENCE, OCCURRENCE_LABEL

MAX_SCOPE = 128


def exact(value: Any) -> Any:
    """Floats as the decimals they were written as (see the module docstring); the rest unchanged."""
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [exact(v) for v in value]
    return value


def occurrence_of(value: Any) -> str | None:
    """A call's ``occurrence`` as its key spells it; None for the first one (absent, or 1)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= MAX_OCCURRENCE:
            raise InvalidIntent(OCCURRENCE, f"an integer from 1 to {MAX_OCCURRENCE}, or a short label")
        return None if value == 1 else str(value)
    if isinstance(value, str) and re.fullmatch(OCCURRENCE_LABEL, value):
        return value
    raise InvalidIntent(
        OCCURRENCE,
        "only to make another one of the same call: 2, 3, ... or a label of letters, digits, '.', '_' or '-' "
        "(at most 64); leave it out for the first one",
    )


def call_key(
    scope: str, action: str, args: dict[str, Any], reference_args: tuple[str, ...] = (), occurrence: Any = None
) -> str:
    """The idempotency key of a tool call (the module docstring says why it is made this way)."""
    if not isinstance(scope, str) or not scope.strip() or len(scope) > MAX_SCOPE:
        raise InvalidIntent("scope", f"required: the host's conversation, run or thread id (1-{MAX_SCOPE} characters)")
    canonical = canonical_value(exact(args))
    if reference_args:
        missing = [a for a in reference_args if canonical.get(a) in (None, "")]
        if missing:
            raise InvalidIntent(f"args.{missing[0]}", "required: it names the business object this call is about")
        ref = "ref=" + ",".join(json.dumps(as_text(canonical[a]), ensure_ascii=False) for a in reference_args)
    else:
        ref = "args=" + hashlib.sha256(dumps_canonical(canonical).encode()).hexdigest()[:32]
    key = f"{scope}:{action}:{ref}"
    if (nth := occurrence_of(occurrence)) is not None:
        key += f":occurrence={nth}"
    if len(key) > MAX_KEY_LEN:  # scope and action included in the hash: never longer than 150
        key = f"{action[:80]}:h={hashlib.sha256(key.encode()).hexdigest()}"
    return key


def retry_key(key: str, action: str, retry_of: str) -> str:
    """The key of a call tried again after the operation ``retry_of`` ended "did not happen"."""
    retried = f"{key}:retry-of={retry_of}"
    if len(retried) > MAX_KEY_LEN:
        retried = f"{action[:80]}:h={hashlib.sha256(retried.encode()).hexdigest()}"
    return retried


def as_text(value: Any) -> str:
    """A reference value as text: the order 81 and the order "81" are one order (a model may write
    either on a retry)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return dumps_canonical(value)
