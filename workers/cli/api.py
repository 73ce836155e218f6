"""``agent-outbox serve`` (the HTTP API) and ``agent-outbox keys create|list|revoke`` (its keys)."""

from __future__ import annotations

import argparse
import json

from outbox.access.keys import create_key, key_json, list_keys, parse_scopes
from outbox.access.revocation import revoke
from outbox.errors import InvalidIntent
from outbox.settings import load_settings
from workers.cli import render
from workers.cli.flags import add_log_level, log_level, operator_name
from workers.cli.ledger import ledger, open_engine
from workers.ground import logs


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="the HTTP API for agent runtimes and operators (needs the [api] extra)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8800)
    add_log_level(p, what="the server's log output (default info)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port (one per core: one process is bound to one core by its GIL); "
        "more than one needs OUTBOX_CONSOLE_SECRET",
    )
    p.set_defaults(func=cmd_serve)

    k = sub.add_parser("keys", help="HTTP API keys: create (shown once), list, revoke")
    ks = k.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    p = ks.add_parser("create", help="a key for one tenant with some scopes; prints the key once")
    p.add_argument("--tenant", required=True)
    p.add_argument("--scope", required=True, help="comma-separated: submit, read, approve, operate")
    p.add_argument("--name", help="what the key is for (shown in keys list)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_create)
    p = ks.add_parser("list", help="keys (never the keys themselves: their first characters)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = ks.add_parser(
        "revoke",
        help="a revoked key is refused from then on (within 5 s); its intents not sent yet go to a person",
    )
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument(
        "--cancel-queued",
        action="store_true",
        help="cancel the key's intents not sent yet instead of handing them to a person",
    )
    p.add_argument("--by", default=None, help="who revokes it (default: your user name)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_revoke)
    k.set_defaults(func=lambda a: k.print_help() or 2)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from workers.server.app import create_app
    except ImportError as exc:
        raise InvalidIntent(
            "serve", f"the HTTP API needs its extra: pip install 'agent-outbox-ledger[api]' ({exc})"
        ) from exc
    settings = load_settings()
    if not 1 <= args.workers <= 64:
        raise InvalidIntent("--workers", "must be from 1 to 64 server processes")
    if args.workers > 1 and not settings.console_secret:
        raise InvalidIntent(
            "OUTBOX_CONSOLE_SECRET",
            "several server processes must sign console sessions with one secret: set it (at least 32 "
            "characters, e.g. `openssl rand -hex 32`), or serve with --workers 1",
        )
    open_engine(settings).dispose()  # the embedded default migrates itself; a server says if it is unreachable
    if args.workers == 1:
        uvicorn.run(
            create_app(settings),
            host=args.host,
            port=args.port,
            log_level=log_level(args, "info").lower(),
            **logs.uvicorn_logging(),
        )
    else:
        _serve_processes(args)
    return 0


def _serve_processes(args: argparse.Namespace) -> None:
    """uvicorn's own supervisor (it restarts a process that dies), on a listening socket that
    says it is TCP. uvicorn binds it with proto 0, accepted connections inherit that, and asyncio
    then leaves Nagle's algorithm on: every keep-alive request after the first waited ~40 ms for the
    client's delayed ACK (20 requests/s from one client instead of ~200; uvicorn issue #3149).
    Re-opened from its descriptor, the socket reports IPPROTO_TCP and every connection gets
    TCP_NODELAY, as with one process. Each process builds its app from the same OUTBOX_*
    environment (create_app() reads it)."""
    import socket

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config(
        "workers.server.app:create_app",
        factory=True,
        workers=args.workers,
        host=args.host,
        port=args.port,
        log_level=log_level(args, "info").lower(),
        **logs.uvicorn_logging(),
    )
    bound = config.bind_socket()
    sock = socket.socket(fileno=bound.detach())  # family, type and proto read back from the kernel
    sock.set_inheritable(True)
    Multiprocess(config, sockets=[sock]).run()


def cmd_create(args: argparse.Namespace) -> int:
    scopes = parse_scopes(args.scope)
    with ledger() as sessions, sessions.begin() as session:
        key, row = create_key(session, tenant=args.tenant, scopes=scopes, name=args.name)
        session.flush()
        session.refresh(row)
        shown = key_json(row) | {"key": key}
    if args.json:
        print(json.dumps(shown, sort_keys=True))
    else:
        print(f"key {shown['id']} for tenant {args.tenant} ({', '.join(scopes)}): {key}")
        print("store it now: it is not shown again (only its SHA-256 is kept)")
    return 0


COLUMNS: list[render.Column] = [
    ("id", lambda r: r["id"]),
    ("prefix", lambda r: r["prefix"]),
    ("tenant", lambda r: r["tenant"]),
    ("scopes", lambda r: ",".join(r["scopes"])),
    ("name", lambda r: r["name"]),
    ("created_at", lambda r: r["created_at"]),
    ("revoked_at", lambda r: r["revoked_at"]),
    ("revoked_by", lambda r: r["revoked_by"]),
]


def cmd_list(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        rows = list_keys(session)
    return render.listing(rows, as_json=args.json, title="{n} key(s)", columns=COLUMNS)


def cmd_revoke(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions.begin() as session:
        done = revoke(session, args.id, by=operator_name(args.by), cancel_queued=args.cancel_queued)
    if args.json:
        print(json.dumps(done.as_dict(), sort_keys=True))
    elif args.cancel_queued:
        print(
            f"key {args.id} revoked: {done.cancelled} queued intent(s) cancelled, {done.cancel_requested} to be "
            "cancelled once a lookup proves an earlier attempt did not land"
        )
    else:
        print(f"key {args.id} revoked: {done.parked} queued intent(s) go to a person (agent-outbox handoffs list)")
    return 0
