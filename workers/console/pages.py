"""The console's pages and forms (``/console``), mounted into the API app (workers/server/app.py).

Every read and decision (list, show, resolve a handoff, approve, deny, reset a breaker) calls the
service layer the API and the CLI call (outbox/service/, workers/service/), so the console adds no
second path to the ledger; workers/console/views.py holds what only its pages show (the overview's
figures, an operation's timeline). A POST without the session's CSRF token is refused (403),
whatever else it carries.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from breaker.errors import BreakerError
from outbox.access.keys import Caller, verify
from outbox.approvals.decisions import pending_json
from outbox.errors import InvalidIntent, NotFound, OutboxError
from outbox.ledger.states import Status
from outbox.runs.lifecycle import run_json
from outbox.service import approvals as approval_service
from outbox.service import handoffs as handoff_service
from outbox.service import operations as operation_service
from outbox.service import runs as run_service
from producer.http.auth import state
from workers.console import views
from workers.console.sessions import CONSOLE_SCOPES, COOKIE, Signer, caller_of
from workers.service import breakers as breaker_service
from workers.service.policies import approval_policies

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(prefix="/console", include_in_schema=False)
static = StaticFiles(directory=str(HERE / "static"))


def signer(request: Request) -> Signer:
    return request.app.state.console_signer  # type: ignore[no-any-return]  # set once by workers/server/app.py


NO_STORE = {
    "Cache-Control": "no-store",  # a tenant's pages stay out of shared caches and the back button
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "Referrer-Policy": "same-origin",
}
LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


def who(request: Request) -> Caller | None:
    key_id = signer(request).key_id(request.cookies.get(COOKIE))
    if key_id is None:
        return None
    with state(request).sessions() as session:
        return caller_of(session, key_id)


def page(request: Request, name: str, caller: Caller | None, **context: Any) -> HTMLResponse:
    cookie = request.cookies.get(COOKIE) or ""
    sign = signer(request)
    csrf = sign.csrf(cookie) if cookie else ""
    error, done, mac = (request.query_params.get(k) for k in ("error", "done", "m"))
    ctx = {
        "caller": caller,
        "csrf": csrf,
        "error": error if sign.flash_ok(error, mac) else None,  # only the console's own messages
        "note": done if sign.flash_ok(done, mac) else None,
    }
    return templates.TemplateResponse(request, name, ctx | context, headers=NO_STORE)


def back(request: Request, path: str, *, error: str | None = None, done: str | None = None) -> RedirectResponse:
    text = error or done
    query = f"?{'error' if error else 'done'}={quote(text)}&m={signer(request).flash(text)}" if text else ""
    return RedirectResponse(f"/console{path}{query}", status_code=303, headers=NO_STORE)


def same_origin(request: Request) -> bool:
    """A POST from the console's own pages, not another site's form (sign-in included: a forged
    sign-in would put the victim into the forger's tenant)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    return origin is None or urlparse(origin).netloc == request.headers.get("host", "")


def secure_cookie(request: Request) -> bool:
    configured = state(request).settings.console_cookie_secure
    if configured is not None:
        return configured
    return request.url.scheme == "https" or (request.url.hostname or "") not in LOOPBACK


def login_first() -> RedirectResponse:
    return RedirectResponse("/console/login", status_code=303)


async def form_of(request: Request) -> dict[str, str] | None:
    """The posted form, or None when its CSRF token is missing or wrong."""
    if not same_origin(request):
        return None
    form = {k: str(v) for k, v in (await request.form()).items()}
    return form if signer(request).csrf_ok(request.cookies.get(COOKIE), form.get("csrf")) else None


def refused(exc: Exception) -> str:
    if isinstance(exc, NotFound):
        return f"no such {exc.what}"  # as the API: the same whether it is another tenant's or nobody's
    return str(exc)


# -- signing in ------------------------------------------------------------------------------
@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request) -> Response:
    return page(request, "login.html", None)


@router.post("/login")
async def login(request: Request) -> Response:
    if not same_origin(request):
        return Response("sign in from the console's own page", status_code=403)
    form = {k: str(v) for k, v in (await request.form()).items()}
    client = request.client.host if request.client else "?"
    st = state(request)
    if st.failures.peek(client) > 0:
        return back(request, "/login", error="too many failed sign-ins from this address; wait a second")
    with st.sessions() as session:
        caller = verify(session, form.get("key", "").strip())
    if caller is None or not caller.scopes & CONSOLE_SCOPES:
        st.failures.take(client)
        return back(request, "/login", error="unknown or revoked key, or a key without the operate or approve scope")
    response = RedirectResponse("/console", status_code=303)
    response.set_cookie(
        COOKIE,
        signer(request).issue(caller.key_id, lifetime_s=st.settings.console_session_s),
        max_age=int(st.settings.console_session_s),
        httponly=True,
        samesite="strict",
        secure=secure_cookie(request),
        path="/console",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    if await form_of(request) is None:
        return Response("missing or wrong CSRF token", status_code=403)
    response = login_first()
    response.delete_cookie(COOKIE, path="/console")
    return response


# -- reading -----------------------------------------------------------------------------------
@router.get("", response_class=HTMLResponse)
def overview(request: Request) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    with state(request).sessions() as session:
        figures = views.counters(session, caller.tenant)
        chart = views.outcome_chart(session, caller.tenant)
    return page(request, "overview.html", caller, figures=figures, chart=chart, breakers=_breakers(request, caller))


@router.get("/counters")
def counters(request: Request) -> Response:
    """The overview's figures as JSON, polled by console.js (no reload)."""
    if (caller := who(request)) is None:
        return JSONResponse({"error": "signed out"}, status_code=401)
    with state(request).sessions() as session:
        figures = views.counters(session, caller.tenant)
    figures["breakers_not_closed"] = sum(1 for b in _breakers(request, caller) if b["state"] != "closed")
    return JSONResponse(figures)


def _breakers(request: Request, caller: Caller) -> list[dict[str, Any]]:
    if "operate" not in caller.scopes:
        return []
    try:
        board = breaker_service.board(state(request).settings)
    except (OutboxError, OSError, BreakerError):
        return []  # no actions file, or Redis away: the page says so instead of failing
    # Per process (no OUTBOX_REDIS_URL): this server cannot see the workers' breakers.
    return [row.as_json() for row in board.breakers] if board.shared else []


@router.get("/operations", response_class=HTMLResponse)
def operations(request: Request, q: str = "", status: str = "", action: str = "", cursor: str = "") -> Response:
    if (caller := who(request)) is None:
        return login_first()
    try:
        for name, text in (("q", q), ("status", status), ("action", action), ("cursor", cursor)):
            if len(text) > 255:
                raise InvalidIntent(name, "at most 255 characters")
        with state(request).sessions() as session:
            found = operation_service.page(
                session,
                caller.tenant,
                status=status or None,
                action=action.strip() or None,
                search=q.strip() or None,
                cursor=cursor or None,
            )
    except InvalidIntent as exc:
        return back(request, "/operations", error=refused(exc))
    return page(
        request,
        "operations.html",
        caller,
        rows=found.operations,
        q=q,
        status=status,
        action=action,
        more=found.next_cursor,
        statuses=[s.value for s in Status],
    )


@router.get("/operations/{operation_id}", response_class=HTMLResponse)
def operation(request: Request, operation_id: str) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    try:
        with state(request).sessions() as session:
            shown = views.timeline(session, operation_service.get(session, caller.tenant, operation_id))
    except NotFound:
        return page(request, "missing.html", caller, what="operation")
    return page(request, "operation.html", caller, **shown)


@router.get("/handoffs", response_class=HTMLResponse)
def handoffs(request: Request) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    rows: list[handoff_service.HandoffRow] = []
    if "operate" in caller.scopes:  # the packets are for operators, as GET /v1/handoffs
        with state(request).sessions() as session:
            rows = handoff_service.listing(session, caller.tenant, limit=200)
    return page(request, "handoffs.html", caller, rows=rows)


@router.get("/approvals", response_class=HTMLResponse)
def approvals(request: Request) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    waiting = []
    if "approve" in caller.scopes:
        with state(request).sessions() as session:
            waiting = approval_service.pending(session, caller.tenant)
    rows = [pending_json(op) for op in waiting]
    deadlines = {op.id: op.deadline_at for op in waiting}
    return page(request, "approvals.html", caller, rows=rows, deadlines=deadlines, now=dt.datetime.now(dt.UTC))


@router.get("/runs", response_class=HTMLResponse)
def runs(request: Request, status: str = "") -> Response:
    if (caller := who(request)) is None:
        return login_first()
    try:
        with state(request).sessions() as session:
            rows = [run_json(session, r) for r in run_service.listing(session, caller.tenant, status=status or None)]
    except InvalidIntent as exc:
        return back(request, "/runs", error=refused(exc))
    return page(request, "runs.html", caller, rows=rows, status=status)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run(request: Request, run_id: str) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    try:
        with state(request).sessions() as session:
            doc = run_service.read(session, caller.tenant, run_id)
    except NotFound:
        return page(request, "missing.html", caller, what="run")
    return page(request, "run.html", caller, run=doc)


@router.get("/breakers", response_class=HTMLResponse)
def breakers(request: Request) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    return page(request, "breakers.html", caller, rows=_breakers(request, caller))


# -- deciding ------------------------------------------------------------------------------------
async def deciding(request: Request, scope: str, page_path: str) -> tuple[Caller, dict[str, str]] | Response:
    """Who decides and what they posted; or the answer when they may not (signed out, the form
    lacks the session's CSRF token or comes from another site, or the key lacks ``scope``)."""
    if (caller := who(request)) is None:
        return login_first()
    if (form := await form_of(request)) is None:
        return Response("missing or wrong CSRF token", status_code=403)
    if scope not in caller.scopes:
        return back(request, page_path, error=f"this key lacks the {scope!r} scope")
    return caller, form


@router.post("/handoffs/{handoff_id}/take")
async def take(request: Request, handoff_id: int) -> Response:  # this session's key owns it: key:<id>
    return await _take_or_release(request, handoff_id, "take")


@router.post("/handoffs/{handoff_id}/release")
async def release(request: Request, handoff_id: int) -> Response:
    return await _take_or_release(request, handoff_id, "release")


async def _take_or_release(request: Request, handoff_id: int, act: str) -> Response:
    if isinstance(got := await deciding(request, "operate", "/handoffs"), Response):
        return got
    caller, form = got
    over = form.get("over") == "1"
    try:
        with state(request).sessions.begin() as session:
            moves = handoff_service.take if act == "take" else handoff_service.release
            moves(session, caller.tenant, handoff_id, identity=caller.identity, over=over)
    except OutboxError as exc:
        return back(request, "/handoffs", error=refused(exc))
    said = f"handoff {handoff_id} taken by {caller.identity}" if act == "take" else f"handoff {handoff_id} released"
    return back(request, "/handoffs", done=said)


@router.post("/handoffs/{handoff_id}/resolve")
async def resolve(request: Request, handoff_id: int) -> Response:
    if isinstance(got := await deciding(request, "operate", "/handoffs"), Response):
        return got
    caller, form = got
    st = state(request)
    try:
        with st.sessions.begin() as session:
            status = handoff_service.resolve(
                session,
                caller.tenant,
                handoff_id,
                resolution=form.get("as", ""),
                by=form.get("by", ""),
                note=form.get("note", ""),
                reference=form.get("reference") or None,
                rules=st.rules,
                identity=caller.identity,
            )
            op = handoff_service.with_operation(session, handoff_service.get(session, caller.tenant, handoff_id))
            new = op.operation.retried_as
    except OutboxError as exc:
        return back(request, "/handoffs", error=refused(exc))
    said = f"handoff {handoff_id} resolved as {form.get('as')}: the operation is {status.value}"
    return back(request, "/handoffs", done=said + (f"; retried as operation {new}" if new else ""))


@router.post("/approvals/{operation_id}/{decision}")
async def decide(request: Request, operation_id: str, decision: str) -> Response:
    if isinstance(got := await deciding(request, "approve", "/approvals"), Response):
        return got
    caller, form = got
    if decision not in ("approve", "deny"):
        return back(request, "/approvals", error=f"unknown decision {decision!r}")
    st = state(request)
    approved = decision == "approve"
    try:
        policies = approval_policies(st.settings) if approved else {}
        with st.sessions.begin() as session:
            approval_service.decide(
                session,
                caller,
                operation_id,
                approved=approved,
                by=form.get("by", ""),
                note=form.get("note") or None,
                policies=policies,
            )
    except OutboxError as exc:
        return back(request, "/approvals", error=refused(exc))
    return back(request, "/approvals", done=f"{operation_id}: {'approved' if approved else 'denied'}")


@router.post("/breakers/{target}/reset")
async def reset(request: Request, target: str) -> Response:
    if isinstance(got := await deciding(request, "operate", "/breakers"), Response):
        return got
    caller, form = got
    reason = (form.get("reason") or "").strip()
    if not reason:
        return back(request, "/breakers", error="reason: say why the breaker may close")
    st = state(request)
    try:
        done = breaker_service.reset_and_wake(
            st.settings, breaker_service.opened(st.sessions), target, by=f"{form.get('by', '')}: {reason}"
        )
    except (OutboxError, BreakerError) as exc:
        return back(request, "/breakers", error=refused(exc))
    # Targets are shared by every tenant: how many of their operations woke is not this tenant's to see.
    return back(request, "/breakers", done=f"{target} reset" + (" (its parked operations woken)" if done.woken else ""))
