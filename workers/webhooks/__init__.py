"""The provider's webhooks, received: signatures verified (signatures.py), events read by the actions
file's mappings (events.py), counted (metrics.py). The ledger applies them (outbox/evidence/webhooks.py)."""
