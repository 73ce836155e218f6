"""The FastAPI application (``agent-outbox serve``): routes, error handlers, the body size limit,
health and readiness."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.errors import (
    ConfigError,
    IdempotencyConflict,
    IllegalTransition,
    InvalidIntent,
    NotFound,
    Refused,
    ReportNotFound,
    RunConflict,
    RunNotMovable,
    SelfApproval,
)
from outbox.ledger.db import SERVER_POOL_WAIT_S, kept_pool_args, make_engine, make_sessionmaker, unreachable
from outbox.ledger.provider_keys import SubmitRules
from outbox.settings import Settings, load_settings
from producer.client import action_rules_for
from producer.http import intents as agents
from producer.http import openapi, runs
from producer.http.auth import ApiState, RateLimiter
from producer.http.intake import BacklogGate
from producer.http.problems import (
    Problem,
    conflict_problem,
    malformed_body,
    not_found,
    problem_response,
    refused_problem,
)
from producer.http.waiters import Waiters
from workers.ground import metrics, tracing
from workers.ground.outage import LEDGER_OUTAGES
from workers.server import operators, subjects, webhooks
from workers.server.request_metrics import RequestMetrics
from workers.service.webhooks import WebhookReceiver

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` (413), whether or not Content-Length is sent."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = Problem(413, "too-large", "Request body too large", f"bodies are limited to {self.max_bytes} bytes")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await problem_response(too_big)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_big
            return message

        try:
            await self.app(scope, limited, send)
        except Problem as exc:
            await problem_response(exc)(scope, receive, send)


def _mount_console(app: FastAPI) -> None:
    """The operator console under /console (workers/console/), when its templates' library is installed."""
    try:
        from workers.console import pages
        from workers.console import subjects as stops_page
    except ImportError as exc:  # jinja2 missing: the API runs, the console says how to get it
        reason = f"the console needs its extra: pip install 'agent-outbox-ledger[api]' ({exc})"

        @app.get("/console", include_in_schema=False)
        def no_console() -> JSONResponse:
            return problem_response(Problem(503, "not-installed", "Console not installed", reason))

        return
    from workers.console.sessions import Signer

    app.state.console_signer = Signer.of(app.state.api.settings.console_secret)  # once: every request signs alike
    app.include_router(pages.router)
    app.include_router(stops_page.router)
    app.mount("/console/static", pages.static, name="console-static")


# How long a request waits for one of the process's connections before it is answered 503 busy.
POOL_WAIT_S = SERVER_POOL_WAIT_S


def _pool(settings: Settings) -> dict[str, Any]:
    """The engine's pool on a server database (SQLite's own pool is left as it is)."""
    return kept_pool_args(settings.resolved_database_url, settings.api_db_connections, POOL_WAIT_S)


def create_app(settings: Settings | None = None, *, rules: SubmitRules | None = None) -> FastAPI:
    settings = settings or load_settings()
    tracing.configure()  # each server process (--workers N builds the app in every one)
    # As many connections kept as the process may use at once (OUTBOX_API_DB_CONNECTIONS), none
    # opened and closed per request (settings.py says why).
    engine = make_engine(settings.resolved_database_url, **_pool(settings))
    sessions = make_sessionmaker(engine)
    api_state = ApiState(
        settings=settings,
        engine=engine,
        sessions=sessions,
        rules=rules if rules is not None else action_rules_for(settings),
        waiters=Waiters(sessions),
        limiter=RateLimiter(settings.api_rate_per_s, max(1.0, settings.api_rate_per_s * 2)),
        backlog=BacklogGate(settings.api_max_backlog),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        api_state.waiters.start()
        try:
            yield
        finally:
            await api_state.waiters.stop()
            engine.dispose()

    app = FastAPI(
        title="agent-outbox",
        version="1",
        description="Intents in, typed outcomes out: the execution layer for agents' side effects.",
        lifespan=lifespan,
    )
    app.state.api = api_state
    app.state.webhooks = WebhookReceiver(settings, sessions)
    app.add_middleware(BodyLimit, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(RequestMetrics)  # outermost: a refused body (413) is a request too

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return problem_response(exc)

    @app.exception_handler(InvalidIntent)
    async def _invalid(request: Request, exc: InvalidIntent) -> JSONResponse:
        # The ledger names fields as the CLI spells them (--by); over HTTP they are body fields (by).
        field = exc.field.lstrip("-") if exc.field else exc.field
        return problem_response(Problem(422, "invalid", "Invalid input", exc.reason, field=field))

    @app.exception_handler(SelfApproval)
    async def _self_approval(request: Request, exc: SelfApproval) -> JSONResponse:
        return problem_response(Problem(403, "separation-of-duties", "Separation of duties", str(exc), field=None))

    @app.exception_handler(IdempotencyConflict)
    async def _conflict(request: Request, exc: IdempotencyConflict) -> JSONResponse:
        return problem_response(conflict_problem(exc))

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> JSONResponse:
        return problem_response(refused_problem(exc))

    @app.exception_handler(RunNotMovable)
    async def _run_not_movable(request: Request, exc: RunNotMovable) -> JSONResponse:
        return problem_response(Problem(409, "conflict", "Conflict", exc.reason, field=None))

    @app.exception_handler(RunConflict)
    async def _run_conflict(request: Request, exc: RunConflict) -> JSONResponse:
        members = {"run_key": exc.run_key, "run_id": exc.run_id}
        return problem_response(
            Problem(409, "run-conflict", "Run conflict", str(exc), field="run_key", members=members)
        )

    @app.exception_handler(NotFound)
    async def _missing(request: Request, exc: NotFound) -> JSONResponse:
        # The same answer whether it exists in another tenant or nowhere: never the ledger's text.
        return problem_response(not_found(exc.what))

    @app.exception_handler(ReportNotFound)
    async def _no_report(request: Request, exc: ReportNotFound) -> JSONResponse:
        return problem_response(Problem(404, "not-found", "Not found", str(exc)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # FastAPI's parse of a body that is not JSON
            ctx = first.get("ctx") or {}
            at = list(first.get("loc", ()))[-1:] or ["?"]
            return problem_response(
                malformed_body(f"not valid JSON ({ctx.get('error', 'decode error')} at character {at[0]})")
            )
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):  # no body at all
            return problem_response(malformed_body("empty; send a JSON object"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        return problem_response(Problem(422, "invalid", "Invalid input", str(first.get("msg")), field=where or None))

    @app.exception_handler(IllegalTransition)
    async def _moved_on(request: Request, exc: IllegalTransition) -> JSONResponse:
        detail = f"the operation moved on meanwhile ({exc}); read it again"
        return problem_response(Problem(409, "conflict", "Conflict", detail))

    @app.exception_handler(ConfigError)
    async def _unconfigured(request: Request, exc: ConfigError) -> JSONResponse:
        return problem_response(Problem(503, "not-configured", "Not configured", str(exc)))

    @app.exception_handler(PoolTimeout)
    async def _busy(request: Request, exc: PoolTimeout) -> JSONResponse:
        # Every connection this process keeps (OUTBOX_API_DB_CONNECTIONS) stayed in use for the whole
        # wait (POOL_WAIT_S): the request's transaction never began. Asking again is safe (an intent's
        # resubmit is answered as any resubmit).
        detail = (
            f"all {settings.api_db_connections} database connections of this server process stayed busy for "
            f"{POOL_WAIT_S:g} s and the request was not carried out: ask again, or raise OUTBOX_API_DB_CONNECTIONS "
            "(or run more server processes)"
        )
        return problem_response(Problem(503, "busy", "Busy", detail, headers={"Retry-After": "1"}))

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        # The ledger's database did not answer (down, restarting, a connection it cut) or refused for
        # now (a statement timeout, a serialization failure). Whether a write under way committed
        # need not be known here: asked again, an intent is found under its key, never made twice.
        cause = getattr(exc, "orig", None) or exc
        detail = (
            f"the ledger's database did not carry out the request ({type(cause).__name__}); ask again in a few "
            "seconds: an intent asked again with the same idempotency key is answered as it is, never made twice"
        )
        return problem_response(Problem(503, "unavailable", "Unavailable", detail, headers={"Retry-After": "5"}))

    # SQLAlchemy's (a checkout, a session's statement) and psycopg's own (the hot path's raw connection).
    for outage in LEDGER_OUTAGES:
        app.add_exception_handler(outage, _unavailable)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, Problem):  # the body limit, hit while FastAPI read a model body
            return problem_response(exc.__cause__)
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI read a model body
            return problem_response(malformed_body(f"not UTF-8 (byte {exc.__cause__.start} cannot be decoded)"))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # RFC 9110: a 405 lists the methods the resource has. The router's own 405 names none
            # for an included router's routes (or only the first route of the path): ask them all.
            allowed = _allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            detail = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
            return problem_response(Problem(405, "method-not-allowed", "Method not allowed", detail, headers=headers))
        title = {404: "Not found"}.get(exc.status_code, "Error")
        kind = title.lower().replace(" ", "-")
        return problem_response(Problem(exc.status_code, kind, title, str(exc.detail), headers=headers))

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "a dependency is unreachable"}})
    def readyz() -> JSONResponse:
        """Readiness: the ledger answers (and Redis, when configured)."""
        down = unreachable(engine)
        checks = {"ledger": "ok" if down is None else f"unreachable: {type(down).__name__}"}
        if settings.redis_url:
            checks["redis"] = _redis_check(settings.redis_url)
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        """This API process's own series (requests by route, their latencies), for Prometheus.
        Nothing of the ledger: the exporter (`agent-outbox metrics`) serves that, once per
        deployment. With several server processes, set PROMETHEUS_MULTIPROC_DIR to sum them."""
        return Response(generate_latest(metrics.process_registry()), media_type=CONTENT_TYPE_LATEST)

    app.include_router(agents.router)
    app.include_router(runs.router)
    app.include_router(operators.router)
    app.include_router(subjects.router)
    app.include_router(webhooks.router)
    _mount_console(app)
    openapi.install(app)
    return app


def _allowed_methods(request: Request) -> list[str]:
    """The methods the requested resource has: those for which a route of the app matches its path
    (asked of the routes themselves, as the router would, so included routers count too). A
    mounted app (the console's static files) answers its own methods: GET and HEAD."""
    routes = [r for r in request.app.router.routes if not isinstance(r, Mount)]
    allowed = [
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in routes)
    ]
    return allowed or ["GET", "HEAD"]


def _redis_check(url: str) -> str:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        client.ping()
        return "ok"
    except redis.RedisError as exc:
        return f"unreachable: {type(exc).__name__}"
    finally:
        client.close()
