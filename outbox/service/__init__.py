"""The use cases every surface calls, for one tenant: the HTTP API, the command line, the console
and the agent tools parse their input, call these, and render the answer.

Each function takes the caller's session (or sessionmaker) and the tenant it acts for; ``None`` is
the command line's operator, who sees every tenant. A record of another tenant does not exist for
the caller: the same ``NotFound`` as a record that exists nowhere. Errors are the ledger's
(outbox/errors.py); each surface maps them to its own answer (problem+json, exit codes, a message
on the page). What needs the breakers lives beside the workers (workers/service/breakers.py).
"""
