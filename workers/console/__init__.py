"""The operator console (operator-facing, DESIGN.md "Surfaces"): web pages under ``/console`` in the
``agent-outbox serve`` process, where people settle what automation cannot.

Server-rendered (Jinja2 templates, one small script that refreshes the counters); the same keys and
tenant scoping as the HTTP API: an operator signs in with a key of scope ``operate`` and/or
``approve``, held as a signed, HTTP-only, SameSite=Strict session cookie; every form carries a CSRF
token. Every action goes through the same functions as the API's operator endpoints.
"""
