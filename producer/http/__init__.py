"""The HTTP API (``agent-outbox serve``): agents submit intents and read typed outcomes over HTTP;
operators resolve handoffs and reset breakers. Optional extra: ``pip install agent-outbox-ledger[api]``.

What agents call over HTTP lives here; the application and the operators' routes are in
``workers/server/`` (``app``, ``operators``, ``subjects``, ``webhooks``).

- ``auth``: who is calling (API keys, scopes, the per-key rate limit) and the app's shared state;
- ``bodies``: request bodies read with the ledger's exact JSON reader (every number a Decimal);
- ``intake``: intake under overload (``OUTBOX_API_MAX_BACKLOG``: 429 with ``Retry-After``);
- ``intents``: submit intents, read operations, wait for an outcome, cancel;
- ``runs``: submit, read and cancel multi-step runs;
- ``openapi``: the OpenAPI document as generated clients and schema-driven tests read it;
- ``problems``: errors as RFC 9457 ``application/problem+json``;
- ``waiters``: the one shared poller behind every long-poll.
"""
