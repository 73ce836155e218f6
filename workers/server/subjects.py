"""An emergency stop of one agent over HTTP (scope ``operate``), as ``agent-outbox subjects`` and the
console make it (outbox/service/subjects.py): in the key's own tenant only.

``POST /v1/subjects/{subject}:stop`` holds every unsent intent of the subject within seconds across the
fleet and refuses its new ones (problem ``subject-stopped``); ``POST /v1/subjects/{subject}:resume``
lifts it; ``GET /v1/subjects`` lists what is stopped, by whom, when and why.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from outbox.access.keys import Caller
from outbox.service import subjects
from outbox.service.inputs import NOTE_MAX
from producer.http.auth import require, state
from producer.http.intents import PROBLEMS
from producer.http.openapi import STORABLE, who_field

router = APIRouter(prefix="/v1", tags=["operators"])
# A subject may hold any character ("agent:support-bot", "team/bot"): the path's rest, up to ":stop".
Subject = Annotated[str, Path(min_length=1, max_length=255, description="the subject, e.g. agent:support-bot")]


class StopIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = who_field("who stops it (recorded with this key's id)")
    reason: str | None = Field(
        default=None,
        max_length=NOTE_MAX,
        description="why (shown with the stop)",
        json_schema_extra={"pattern": STORABLE},
    )


class ResumeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = who_field("who resumes it (recorded with this key's id)")


@router.get("/subjects", responses=PROBLEMS)
def list_stops(request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> dict[str, Any]:
    """This tenant's stopped subjects: by whom, when, why."""
    with state(request).sessions() as session:
        return {"stops": subjects.listing(session, caller.tenant)}


@router.post("/subjects/{subject:path}:stop", responses=PROBLEMS)
def stop_subject(
    subject: Subject, body: StopIn, request: Request, caller: Annotated[Caller, Depends(require("operate"))]
) -> dict[str, Any]:
    """Hold every unsent intent of the subject (held: how many were queued), refuse its new ones; calls
    already out finish and settle. Stopping it again keeps the first stop."""
    with state(request).sessions.begin() as session:
        return subjects.stop(
            session, caller.tenant, subject, by=body.by, reason=body.reason, identity=f"api:key-{caller.key_id}"
        )


@router.post("/subjects/{subject:path}:resume", responses=PROBLEMS)
def resume_subject(
    subject: Subject, body: ResumeIn, request: Request, caller: Annotated[Caller, Depends(require("operate"))]
) -> dict[str, Any]:
    """Lift the stop: its held intents are due at once (woken: how many), each sent once."""
    with state(request).sessions.begin() as session:
        return subjects.resume(session, caller.tenant, subject, by=body.by, identity=f"api:key-{caller.key_id}")
