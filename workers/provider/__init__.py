"""The downstream contract: what we know about the providers our workers call.

- ``actions``: the actions file (targets, requests, lookups, listings, budgets, breakers);
- ``http_request``: building one exact request from an intent's arguments;
- ``connectors``: sending it, and asking the provider what became of a key (lookups);
- ``classify``: the one table that says what a response or a failure proves;
- ``retry``: when to try again (Retry-After, backoff with jitter, the budget);
- ``listing_report``: reading the provider's own listing to compare it with the ledger.

Nothing here writes to the ledger; the processes in ``workers/`` do, through ``outbox/``.
"""
