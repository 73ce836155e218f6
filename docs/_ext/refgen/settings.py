"""Every ``OUTBOX_*`` setting, read from ``outbox.settings.Settings``: its variable, type, default and
what the code says it is for (the field's description and the comment above it)."""

from __future__ import annotations

from refgen.comments import field_comments
from refgen.fields import constraints, default_text, type_name
from refgen.markdown import GENERATED, code, joined, table


def render() -> str:
    from outbox.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    comments = field_comments(Settings)
    rows = []
    for name, info in Settings.model_fields.items():
        meaning = joined(info.description or "", comments.get(name, ""))
        kind = type_name(info.annotation)
        bounds = constraints(info)
        rows.append(
            (code(f"{prefix}{name}".upper()), kind + (f" ({bounds})" if bounds else ""), default_text(info), meaning)
        )
    return "\n".join([GENERATED.format(name="settings"), "", *table(("variable", "type", "default", "meaning"), rows)])
