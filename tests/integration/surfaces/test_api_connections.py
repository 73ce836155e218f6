"""An API server process keeps its database connections (OUTBOX_API_DB_CONNECTIONS): eight clients
posting at once are served on connections opened once, not on new ones every few requests.

SQLAlchemy's default pool kept five and closed every other connection on its return: eight clients
made PostgreSQL start a backend (and the server connect again) for one request in nine (441 new
sessions in 4,000 requests), and one server process answered 452-511 intents/s instead of 639-715
(bench/README.md, issue 56). PostgreSQL counts the sessions opened to the database itself."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from outbox.access.keys import create_key
from outbox.settings import Settings
from tests.harness import REFUND_ARGS, database_sessions
from workers.server.app import create_app

pytestmark = pytest.mark.postgres


def test_eight_clients_at_once_are_served_on_connections_opened_once(pg_ledger: Any, tmp_path: Any) -> None:
    with pg_ledger.sessions.begin() as s:
        key = create_key(s, tenant="t1", scopes=["submit"])[0]
    settings = Settings(database_url=pg_ledger.url, data_dir=tmp_path, api_rate_per_s=1_000_000)
    headers = {"Authorization": f"Bearer {key}"}

    with TestClient(create_app(settings), base_url="http://localhost") as client:

        def post(name: str, n: int) -> None:
            for i in range(n):
                body = {"action": "payments.refund.create", "idempotency_key": f"{name}-{i}", "args": REFUND_ARGS}
                answered = client.post("/v1/intents", json=body, headers=headers)
                assert answered.status_code == 201, answered.text

        time.sleep(1.1)  # the app's own start-up connections counted (a backend counts at its first transaction)
        before = database_sessions(pg_ledger.url)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(post, [f"c{k}" for k in range(8)], [100] * 8))
        time.sleep(1.1)
        opened = database_sessions(pg_ledger.url) - before
    # At most one per client at once (the pool keeps up to 15); SQLAlchemy's default pool opened dozens.
    assert opened <= 10, opened
    with pg_ledger.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT count(*) FROM outbox_operations").scalar_one()
    assert stored == 800


def test_a_request_that_finds_every_connection_busy_is_answered_503_busy_and_not_carried_out(
    pg_ledger: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    """OUTBOX_API_DB_CONNECTIONS=1 and that one connection held: the request waits the pool's time
    (shortened here) and is answered 503 ``busy`` with Retry-After; nothing stored. Asked again once
    a connection is free, it is carried out."""
    from workers.server import app as server

    monkeypatch.setattr(server, "POOL_WAIT_S", 0.3)
    with pg_ledger.sessions.begin() as s:
        key = create_key(s, tenant="t1", scopes=["submit"])[0]
    settings = Settings(database_url=pg_ledger.url, data_dir=tmp_path, api_db_connections=1)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"action": "payments.refund.create", "idempotency_key": "busy-1", "args": REFUND_ARGS}
    app = create_app(settings)
    with TestClient(app, base_url="http://localhost") as client:
        held = app.state.api.engine.connect()  # the process's only connection
        try:
            answered = client.post("/v1/intents", json=body, headers=headers)
        finally:
            held.close()
        assert answered.status_code == 503, answered.text
        assert answered.json()["type"].endswith("/busy") and answered.headers["Retry-After"] == "1"
        assert "OUTBOX_API_DB_CONNECTIONS" in answered.json()["detail"]
        with pg_ledger.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM outbox_operations").scalar_one() == 0
        again = client.post("/v1/intents", json=body, headers=headers)
        assert again.status_code == 201, again.text


def test_a_request_whose_database_connection_was_cut_is_503_unavailable_and_asked_again_made_once(
    pg_ledger: Any, tmp_path: Any
) -> None:
    """PostgreSQL cuts the server's connections to the ledger (pg_terminate_backend: as a restart, a
    failover or a proxy's idle timeout would). The next request runs on a dead connection: it is answered 503
    ``unavailable`` with Retry-After, not a 500 (which says "our bug" and invites no retry). Asked
    again with the same key, the intent is made, once; asked a third time, it is found."""
    from sqlalchemy.engine import make_url

    # The server's connections by name: only they are cut (this process's other tests share the database).
    name = "api-cut-test"
    url = make_url(pg_ledger.url).update_query_dict({"application_name": name}).render_as_string(hide_password=False)
    with pg_ledger.sessions.begin() as s:
        key = create_key(s, tenant="t1", scopes=["submit"])[0]
    settings = Settings(database_url=url, data_dir=tmp_path)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"action": "payments.refund.create", "idempotency_key": "cut-1", "args": REFUND_ARGS}
    warm = {**body, "idempotency_key": "warm-1"}
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        assert client.post("/v1/intents", json=warm, headers=headers).status_code == 201
        with pg_ledger.engine.connect() as admin:
            cut = admin.exec_driver_sql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).scalar_one()
        assert cut >= 1
        answered = client.post("/v1/intents", json=body, headers=headers)
        assert answered.status_code == 503, answered.text
        assert answered.json()["type"].endswith("/unavailable") and answered.headers["Retry-After"] == "5"
        assert "same idempotency key" in answered.json()["detail"]
        again = client.post("/v1/intents", json=body, headers=headers)
        third = client.post("/v1/intents", json=body, headers=headers)
    assert again.status_code == 201, again.text
    assert third.status_code == 200 and third.json()["operation_id"] == again.json()["operation_id"], third.text
    with pg_ledger.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT count(*) FROM outbox_operations WHERE idempotency_key = 'cut-1'")
        assert stored.scalar_one() == 1
