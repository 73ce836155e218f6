"""The console's pages under bad input (issue 20): a broken cookie, odd characters, a forged cursor,
an unknown state, an impossible handoff id, a POST without its token. None may answer 500; the
operator gets a page that says what was wrong. In-process (FastAPI's TestClient), on both ledgers."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from outbox.access.keys import create_key
from outbox.settings import Settings
from workers.server.app import create_app


@pytest.fixture
def console(ledger: Any, tmp_path: Any) -> Any:
    with ledger.sessions.begin() as s:
        key, _ = create_key(s, tenant="t1", scopes=["operate", "approve"])
    settings = Settings(database_url=ledger.url, data_dir=tmp_path)
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        signed_in = client.post("/console/login", data={"key": key}, follow_redirects=False)
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/console"
        yield client


def test_bad_input_never_answers_500(console):
    for path in (
        "/console/operations?q=%00",
        "/console/operations?cursor=not-a-cursor",
        "/console/operations?status=bogus",
        "/console/operations?q=" + "k" * 300,
        "/console/operations/%00",
        "/console/operations/not-a-uuid",
        "/console/runs?status=bogus",
        "/console/runs/00000000-0000-0000-0000-000000000000",
    ):
        answered = console.get(path)
        assert answered.status_code == 200, (path, answered.status_code, answered.text[:300])
        assert answered.headers["cache-control"] == "no-store"
    csrf = console.get("/console").text.split('name="csrf" value="')[1].split('"')[0]
    huge = console.post(
        f"/console/handoffs/{2**70}/resolve", data={"csrf": csrf, "as": "abandoned", "note": "x", "by": "y"}
    )
    assert huge.status_code == 200 and "no such handoff" in huge.text
    assert console.post("/console/breakers/sandbox/reset", data={"by": "a", "reason": "b"}).status_code == 403
    assert (
        console.post("/console/breakers/sandbox/reset", data={"csrf": "é", "by": "a", "reason": "b"}).status_code == 403
    )


def test_a_broken_or_foreign_cookie_is_a_signed_out_visitor(console):
    console.cookies.clear()
    for value in ("1.2.3.é".encode(), b"garbage", b"1.9999999999.abc.0000", b""):
        seen = console.get("/console", headers={"cookie": b"outbox_console=" + value}, follow_redirects=False)
        assert seen.status_code == 303 and seen.headers["location"] == "/console/login", value
