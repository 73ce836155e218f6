"""The operator console (issue 20) in a real browser: Debian's chromium driven by Playwright (never a
downloaded browser), against ``agent-outbox serve`` as a subprocess, real workers, relay, PostgreSQL,
Redis and the sandbox. Screenshots of each page go to ``artifacts/console/`` (CI keeps them).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import action, actions_doc, pk, wait_for
from tests.integration.surfaces.test_api import _key, _serve

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.postgres, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[3]
SHOTS = ROOT / "artifacts" / "console"
REFUND = "payments.refund.create"
BIG = {"order_id": "o-9", "amount": "900.00", "currency": "EUR", "reason": "damaged"}
SMALL = {"order_id": "o-1", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


@pytest.fixture(scope="module")
def chromium() -> Any:
    from tests.conftest import service_missing

    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        service_missing("chromium", "Debian's chromium is not installed", get_it="apt-get install chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _sign_in(browser: Any, url: str, key: str) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{url}/console")
    assert page.url.endswith("/console/login")
    page.fill("#key", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/console")
    return page


def test_an_operator_settles_what_automation_cannot(pipe, sandbox, chromium):
    from breaker import BreakerConfig, BreakerRegistry

    refund = action(
        "/v1/refunds",
        decimal_args=["amount"],
        lookup=None,
        approval={"required": "when", "when": "amount > 500", "ttl_s": 600},
    )
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))
    # The provider refuses before executing, but the client sees a 500: ambiguous, and with no lookup
    # a person decides. The fault fires once: a "not executed" re-dispatch then succeeds.
    sandbox.add_fault(mode="fail_before_commit", method="POST", status=500, key_pattern=pk("c-lost"), count=1)
    pipe.start_worker()
    pipe.start_relay()
    lost = pipe.submit("c-lost", dict(SMALL)).operation_id
    big = pipe.submit("c-big", dict(BIG), rules=_rules(pipe), subject="agent:bot").operation_id
    bigger = pipe.submit("c-bigger", dict(BIG, order_id="o-10"), rules=_rules(pipe), subject="agent:bot").operation_id
    pipe.wait_status(lost, "reconciliation_required")
    other = pipe.submit("c-other", dict(SMALL), tenant="t2").operation_id

    with _serve(pipe) as api:
        key = _key(api.env, "t1", "operate,approve")
        page = _sign_in(chromium, api.url, key)
        assert page.locator(".card [data-counter=handoffs_open]").inner_text() == "1"
        _shot(page, "overview")

        # Find the operation by its key, see its timeline.
        page.click("text=Operations")
        page.fill("input[name=q]", "c-lost")
        page.click("text=Search")
        page.click("a:text('c-lost')")
        assert "reconciliation_required" in page.inner_text("#state")
        assert page.locator("tr.attempt").count() >= 1
        _shot(page, "operation")

        # The handoff: resolved as not executed -> sent again with the same key -> succeeded.
        page.click("nav >> text=Handoffs")
        _shot(page, "handoffs")
        form = page.locator("form.decide").first
        form.locator("input[value=not-executed]").check()
        form.locator("input[name=note]").fill("the provider's dashboard shows no refund for o-1")
        form.locator("input[name=by]").fill("ada")
        form.locator("button").click()
        assert "resolved as not-executed" in page.inner_text("main")
        wait_for(
            lambda: pipe.op(lost).status == "succeeded",
            20,
            what=lambda: f"{pipe.op(lost).status}: {pipe.op(lost).reason}",
        )
        assert len(sandbox.effects(key=pk("c-lost"))) == 1
        page.goto(f"{api.url}/console/operations/{lost}")
        assert "succeeded" in page.inner_text("#state") and "resolved: not executed" in page.inner_text("table")

        # Approvals: approve one, deny the other.
        page.click("nav >> text=Approvals")
        _shot(page, "approvals")
        first = page.locator("article.approval").filter(has=page.locator("a", has_text=re.compile(r"^c-big$")))
        first.locator("form[action$='/approve'] input[name=by]").fill("alice")
        first.locator("form[action$='/approve'] button").click()
        assert "approved" in page.inner_text("main")
        second = page.locator("article.approval").filter(has=page.locator("a", has_text=re.compile(r"^c-bigger$")))
        second.locator("form[action$='/deny'] input[name=by]").fill("alice")
        second.locator("form[action$='/deny'] input[name=note]").fill("duplicate request")
        second.locator("form[action$='/deny'] button").click()
        assert "denied" in page.inner_text("main")
        pipe.wait_status(big, "succeeded")
        assert pipe.op(bigger).status == "cancelled" and sandbox.requests(method="POST", key=pk("c-bigger")) == []

        # The breaker: opened through the shared state (as a worker's failures would) while the overview
        # is open; its counter updates without a reload; then it is reset with a reason.
        page.goto(f"{api.url}/console")
        assert page.locator(".card [data-counter=breakers_not_closed]").inner_text() == "0"
        breakers = BreakerRegistry(
            {"sandbox": BreakerConfig(fail_max=1, reset_timeout_s=300)},
            redis_url=pipe.env["OUTBOX_REDIS_URL"],
            namespace=pipe.env["OUTBOX_BROKER_KEY_PREFIX"],
        )
        breakers.record(breakers.before_call("sandbox"), failure=True)
        breakers.close()
        wait_for(
            lambda: page.locator(".card [data-counter=breakers_not_closed]").inner_text() == "1",
            15,
            what="the overview's counter refreshed without a reload",
        )
        page.click("nav >> text=Breakers")
        assert "open" in page.inner_text("table")
        _shot(page, "breakers")
        page.fill("form.decide input[name=by]", "ada")
        page.fill("form.decide input[name=reason]", "provider confirmed the outage is over")
        page.click("form.decide button")
        assert "sandbox reset" in page.inner_text("main")

        page.click("nav >> text=Runs")
        _shot(page, "runs")
        page.goto(f"{api.url}/console")
        wait_for(
            lambda: page.locator(".card [data-counter=handoffs_open]").inner_text() == "0", 15, what="counters shown"
        )
        _shot(page, "overview-after")  # docs/how-to/console.md's picture (docs/console-overview.png)

        # A second tenant's operator sees none of the first tenant's data.
        other_key = _key(api.env, "t2", "operate,approve")
        theirs = _sign_in(chromium, api.url, other_key)
        theirs.goto(f"{api.url}/console/operations")
        listed = theirs.inner_text("table")
        assert "c-other" in listed and "c-lost" not in listed and "c-big" not in listed
        theirs.goto(f"{api.url}/console/operations/{lost}")
        assert "Not found" in theirs.inner_text("main")
        assert other  # t2's own operation is the only one it sees

        # A form posted without the CSRF token is refused, whatever the cookie says.
        cookies = {c["name"]: c["value"] for c in page.context.cookies()}
        bare = httpx.post(
            f"{api.url}/console/breakers/sandbox/reset", data={"by": "eve", "reason": "x"}, cookies=cookies, timeout=5
        )
        assert bare.status_code == 403
        forged = httpx.post(
            f"{api.url}/console/breakers/sandbox/reset",
            data={"by": "eve", "reason": "x", "csrf": "0" * 40},
            cookies=cookies,
            timeout=5,
        )
        assert forged.status_code == 403
        # A sign-in posted from another site is refused (it would put the victim in the forger's tenant),
        # and a crafted link cannot put its own words into the console's alert boxes.
        cross = httpx.post(
            f"{api.url}/console/login", data={"key": key}, headers={"Origin": "http://evil.example"}, timeout=5
        )
        assert cross.status_code == 403
        page.goto(f"{api.url}/console/handoffs?error=paste+your+key+at+evil.example&m=0")
        assert "evil.example" not in page.inner_text("main")
        # Signed out, nothing is shown.
        assert re.search("login", httpx.get(f"{api.url}/console/handoffs", timeout=5, follow_redirects=True).url.path)


def _rules(pipe: Any) -> Any:
    from workers.provider.actions import load_actions

    return load_actions(pipe.env["OUTBOX_ACTIONS_FILE"])
