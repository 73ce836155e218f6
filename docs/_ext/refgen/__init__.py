"""Reference pages generated from the code at build time (docs/_ext/outbox_docs.py runs them).

Each module renders one reference as Markdown: the CLI from its argparse parsers, the settings from
``outbox.settings.Settings``, the states and moves from ``outbox.ledger.states``, the metrics from
the collectors' source, the HTTP API from the FastAPI app's OpenAPI document, the actions file from
its pydantic models. A new flag, setting, state, metric, route or key appears without editing a page.
"""
