"""The HTTP API (``agent-outbox serve``): agents submit intents and read typed outcomes over HTTP;
operators resolve handoffs and reset breakers. Optional extra: ``pip install agent-outbox-ledger[api]``.

- ``keys``: API keys (one tenant, some scopes), stored as hashes in the ledger;
- ``app``: the FastAPI application (problem+json errors, size and rate limits, auth);
- ``agents``: what agent runtimes call (intents, operations, wait);
- ``operators``: what people call (handoffs, breakers);
- ``waiters``: the one shared poller behind every long-poll.
"""
