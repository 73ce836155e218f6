"""Every state of an operation, every allowed move and what causes it (``outbox.ledger.states``)."""

from __future__ import annotations

from refgen.comments import field_comments
from refgen.markdown import GENERATED, code, table


def render() -> str:
    from outbox.ledger import states as s

    def kinds(status: s.Status) -> str:
        marks = []
        if status in s.TERMINAL:
            marks.append("terminal")
        if status in s.EFFECT:
            marks.append("effect")
        if status in s.NO_EFFECT:
            marks.append("no effect")
        if status in s.DISPATCH_CLAIMABLE:
            marks.append("claimed by workers")
        if status in s.RECONCILE_CLAIMABLE:
            marks.append("claimed by the reconciler")
        return ", ".join(marks)

    out = [GENERATED.format(name="states"), "", "## States", ""]
    out += table(("state", "meaning", "kind"), [(code(st.value), s.MEANING[st], kinds(st)) for st in s.Status])
    out += ["## Moves", "", "Every move the ledger allows (`ALLOWED`); anything else is refused.", ""]
    out += table(
        ("from", "to", "caused by"), [(code(a.value), code(b.value), why) for (a, b), why in s.ALLOWED.items()]
    )
    out += ["## Why an operation waits (`waiting_for`)", ""]
    out += table(("value", "meaning"), [(code(w.value), s.WAITING_MEANING.get(w, "")) for w in s.WaitingFor])
    out += ["## Attempt classes", ""]
    said = field_comments(s.AttemptClass)
    out += table(("class", "what the attempt proved"), [(code(c.value), said.get(c.name, "")) for c in s.AttemptClass])
    out += ["## History events", "", "The `event` of each row of an operation's `history`.", ""]
    said = field_comments(s.EventKind)
    out += table(("event", "note"), [(code(e.value), said.get(e.name, "")) for e in s.EventKind])
    return "\n".join(out)
