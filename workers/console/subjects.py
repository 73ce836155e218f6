"""The console's page of emergency stops (``/console/subjects``): which agents (subjects) of this
tenant are stopped, by whom, when and why, with a stop and a resume control for operators.

Reads and decisions call the service layer the API and the CLI call (outbox/service/subjects.py): a
stop is the key's own tenant's; the person is written down as who they said they are and the key.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from outbox.errors import OutboxError
from outbox.service import subjects as subject_service
from producer.http.auth import state
from workers.console.pages import back, deciding, login_first, page, refused, who

router = APIRouter(prefix="/console", include_in_schema=False)


@router.get("/subjects", response_class=HTMLResponse)
def subjects(request: Request) -> Response:
    if (caller := who(request)) is None:
        return login_first()
    rows = []
    if "operate" in caller.scopes:  # as GET /v1/subjects
        with state(request).sessions() as session:
            rows = subject_service.listing(session, caller.tenant)
    return page(request, "subjects.html", caller, rows=rows)


@router.post("/subjects/stop")
async def stop(request: Request) -> Response:
    if isinstance(got := await deciding(request, "operate", "/subjects"), Response):
        return got
    caller, form = got
    subject = (form.get("subject") or "").strip()
    try:
        with state(request).sessions.begin() as session:
            done = subject_service.stop(
                session,
                caller.tenant,
                subject,
                by=form.get("by", ""),
                reason=(form.get("reason") or "").strip() or None,
                identity=f"api:key-{caller.key_id}",
            )
    except OutboxError as exc:
        return back(request, "/subjects", error=refused(exc))
    return back(request, "/subjects", done=f"{subject} stopped: {done['held']} queued intent(s) held")


@router.post("/subjects/resume")
async def resume(request: Request) -> Response:
    if isinstance(got := await deciding(request, "operate", "/subjects"), Response):
        return got
    caller, form = got
    subject = form.get("subject") or ""
    by = form.get("by", "")
    try:
        with state(request).sessions.begin() as session:
            done = subject_service.resume(session, caller.tenant, subject, by=by, identity=f"api:key-{caller.key_id}")
    except OutboxError as exc:
        return back(request, "/subjects", error=refused(exc))
    return back(request, "/subjects", done=f"{subject} resumed: {done['woken']} held intent(s) due now")
