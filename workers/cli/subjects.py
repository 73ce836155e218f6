"""``agent-outbox subjects stop|resume|list``: an emergency stop of one agent (a ``subject``) in one tenant.

A stop holds every unsent intent of the subject within seconds across the fleet and refuses new ones;
calls already out finish and settle as usual. ``resume`` lifts it: the held intents are sent, each once.
"""

from __future__ import annotations

import argparse

from outbox.service import subjects
from outbox.settings import load_settings
from workers.cli import render
from workers.cli.flags import operator_name
from workers.cli.ledger import ledger


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("subjects", help="an emergency stop of one agent (subject): stop, resume, list")
    ss = s.add_subparsers(dest="subjects_command", metavar="SUBCOMMAND")
    p = ss.add_parser(
        "stop", help="hold every unsent intent of SUBJECT (within seconds, every worker) and refuse new ones"
    )
    p.add_argument("subject", metavar="SUBJECT", help="as intents name it, e.g. agent:support-bot")
    p.add_argument("--tenant", help="tenant (default: OUTBOX_DEFAULT_TENANT)")
    p.add_argument("--by", default=None, help="who stops it (default: your user name)")
    p.add_argument("--reason", help="why (shown with the stop, in the held intents' reason and the console)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stop)
    p = ss.add_parser("resume", help="lift the stop: the held intents are due at once, each sent once")
    p.add_argument("subject", metavar="SUBJECT")
    p.add_argument("--tenant", help="tenant (default: OUTBOX_DEFAULT_TENANT)")
    p.add_argument("--by", default=None, help="who resumes it (default: your user name)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resume)
    p = ss.add_parser("list", help="the subjects stopped now: by whom, when, why")
    p.add_argument("--tenant", help="only this tenant's (default: every tenant's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    s.set_defaults(func=lambda args: s.print_help() or 2)


COLUMNS: list[render.Column] = [
    ("tenant", lambda r: r["tenant"]),
    ("subject", lambda r: r["subject"]),
    ("stopped by", lambda r: r["stopped_by"]),
    ("stopped at", lambda r: r["stopped_at"]),
    ("reason", lambda r: r["reason"]),
]


def cmd_stop(args: argparse.Namespace) -> int:
    settings = load_settings()
    tenant = args.tenant or settings.default_tenant
    with ledger(settings) as sessions, sessions.begin() as session:
        done = subjects.stop(session, tenant, args.subject, by=operator_name(args.by), reason=args.reason)
    if args.json:
        render.emit_json(done)
    elif done["new"]:
        print(
            f"{args.subject} stopped in tenant {tenant} by {done['stopped_by']}: {done['held']} queued intent(s) held"
        )
    else:
        print(
            f"{args.subject} was already stopped in tenant {tenant} by {done['stopped_by']} at {done['stopped_at']}; "
            f"{done['held']} queued intent(s) held"
        )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    settings = load_settings()
    tenant = args.tenant or settings.default_tenant
    with ledger(settings) as sessions, sessions.begin() as session:
        done = subjects.resume(session, tenant, args.subject, by=operator_name(args.by))
    if args.json:
        render.emit_json(done)
    else:
        print(f"{args.subject} resumed in tenant {tenant}: {done['woken']} held intent(s) due now")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        rows = subjects.listing(session, args.tenant)
    return render.listing(rows, as_json=args.json, title="{n} subject(s) stopped", columns=COLUMNS)
