"""The reconciliation report: the ledger compared with what each provider lists.

For every action that declares a ``list`` request (``ListSpec``), page through the provider's
listing since the window start (through the target's pooled httpx client) and compare:

- record_without_document: the ledger says succeeded (or committed_evidence_degraded), the
  provider lists no object with that idempotency key or reference;
- document_without_record: a provider object whose key has no operation in the ledger, or no
  operation that holds the effect as done;
- duplicates: more than one provider object for one business key (two effects for one intent);

- state_contradictions: operations whose own attempts contradict their state, read from the
  ledger alone (outbox/reads/report.py): a confirmed success beside failed_before_commit, an attempt
  that may still land beside a "no effect" state, a success not yet applied, a second reference.

Keys are the provider keys (outbox/ledger/provider_keys.py: tenant-scoped), so a document maps to its
tenant's operation only; where a target gives each tenant its own account, each account's listing
is read with that tenant's credentials and compared with that tenant's operations alone. A
document's ``idempotency_key`` field is the key as the provider lists it.

Plus the health figures of ``outbox/reads/report.py``. ``{since}`` in a list request is the window
start in epoch seconds (with LISTING_SLACK_S of slack); ``{cursor}`` is the page cursor ("" on the
first page), or name the cursor's query parameter with ``cursor_param``.

The JSON object (``REPORT_VERSION`` 1; fields are only ever added):

    {"version": 1, "generated_at": ISO, "since": ISO,
     "discrepancy_count": int, "complete": bool,
     "by_tenant": {tenant: {kind: count}},   # "(unknown)": documents no operation claims
     "discrepancies": {
        "record_without_document": [{"operation_id", "tenant", "idempotency_key", "provider_key", "action",
                                     "status", "reference", "finished_at", "target"}],
        "document_without_record": [{"target", "tenant", "actions", "idempotency_key", "reference",
                                     "status", "why", "ledger": [operation, ...],
                                     "source"?: "webhook", "event_id"?}],   # an event no operation took
        "duplicates": [{"target", "tenant", "actions", "idempotency_key", "count", "references"}],
        "state_contradictions": [{"operation_id", "tenant", "idempotency_key", "action", "status",
                                  "reference", "finished_at", "why",
                                  "attempt": {"attempt_number", "kind", "fencing_token", "class",
                                              "reference", "stale"} | null}]},
     "listings": [{"target", "tenant", "actions", "request", "documents", "pages", "error"}],
     "actions_without_listing": [name, ...],
     "too_recent": int,   # successes younger than the lookup's settle_s: not compared (index lag)
     "possible_duplicates_by_object": [{"tenant", "action", "object", "by", "window_s", "count",
                                        "operations": [{"operation_id", "idempotency_key", "status",
                                                        "reference", "created_at"}]}],
     "health": {"operations": int, "duplicate_effects": int,
                "failure_attributability": {"operations", "attributable", "share"},
                "auto_recovery": {"operations", "recovered", "rate"},
                "handoffs": {"open", "resolved", "time_to_resolution_s": {"median", "max"}},
                "retries_by_target": {target: {"retries", "billable"}},
                "possible_duplicates_by_object": int, "key_conflicts": int, "key_replays": int,
                "first_time_resolution": {"settled", "first_time", "ratio"},
                "by_tenant": {tenant: {"possible_duplicates_by_object", "key_conflicts", "key_replays",
                                       "first_time_resolution": {"settled", "first_time", "ratio"}}}}}

Possible duplicates by business object (outbox/reads/same_effect.py: two keys, one object, both
succeeded within ``same_object_window_s``) are for a person to review, not discrepancies: they are
not in ``discrepancy_count`` and do not fail the report (a second partial refund may be meant).
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy.orm import Session

from outbox.actions.specs import ListSpec
from outbox.reads import report as ledger
from outbox.reads.counters import report_figures
from outbox.reads.same_effect import DEFAULT_WINDOW_S
from outbox.reads.webhook_events import documents_without_record as webhook_documents
from workers.provider.actions import ActionConfig, ActionsFile
from workers.provider.classify import LocalValidationError, extract
from workers.provider.connectors import HttpConnector
from workers.provider.http_request import prepare

REPORT_VERSION = 1
# Provider clocks and ours differ, and an object is created before our success is recorded:
# list from a little before the earliest operation compared, so none falls off the edge.
LISTING_SLACK_S = 60.0
# A listing that never ends (a provider bug, a cursor that does not advance) must not hang the
# report: 1,000 pages of 100 is far beyond one day of a busy action.
MAX_PAGES = 1000
# Where the idempotency key sits in a listed object when the lookup does not say (key_field).
DEFAULT_KEY_FIELD = "idempotency_key"


class ListingUnavailable(Exception):
    """The provider's listing could not be read completely; the report is incomplete."""


@dataclass
class Listing:
    """One provider listing (actions sharing the same request share one listing). ``tenant``: the
    tenant whose own account (targets.<name>.tenants) this listing reads; None: one account for all."""

    target: str
    actions: list[str]
    spec: ListSpec
    tenant: str | None = None
    documents: list[dict[str, Any]] = field(default_factory=list)
    pages: int = 0
    error: str | None = None

    def describe(self) -> dict[str, Any]:
        req = self.spec.request
        return {
            "target": self.target,
            "tenant": self.tenant,
            "actions": self.actions,
            "request": f"{req.method} {req.path}",
            "documents": len(self.documents),
            "pages": self.pages,
            "error": self.error,
        }


def group_listings(actions: ActionsFile) -> tuple[list[Listing], list[str]]:
    """Listings to read (one per distinct target + list request, and per tenant where the target
    gives each tenant its own account), and actions without a listing."""
    groups: dict[tuple[str, str, str | None], Listing] = {}
    unlisted: list[str] = []
    for name, action in sorted(actions.actions.items()):
        if action.listing is None:
            unlisted.append(name)
            continue
        accounts: list[str | None] = [*sorted(actions.targets[action.target].accounts)] or [None]
        for tenant in accounts:
            ident = (action.target, action.listing.model_dump_json(), tenant)
            if ident not in groups:
                groups[ident] = Listing(action.target, [], action.listing, tenant)
            groups[ident].actions.append(name)
    return list(groups.values()), unlisted


def read_listing(client: httpx.Client, listing: Listing, *, since_epoch_s: float) -> None:
    """Page through the listing into ``listing.documents``; raises ListingUnavailable."""
    spec = listing.spec
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        try:
            prepared = prepare(
                spec.request,
                {},
                idempotency_key="",
                send_rest=False,
                extra={"since": int(since_epoch_s), "cursor": cursor or ""},
            )
        except LocalValidationError as exc:
            raise ListingUnavailable(f"cannot build the list request: {exc}") from exc
        query: dict[str, Any] = dict(prepared.query)
        if spec.page_size_param:
            query[spec.page_size_param] = spec.page_size
        if spec.cursor_param and cursor is not None:
            query[spec.cursor_param] = cursor
        try:
            response = client.request(prepared.method, prepared.path, params=query or None, headers=prepared.headers)
        except httpx.HTTPError as exc:
            raise ListingUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= response.status_code < 300:
            raise ListingUnavailable(f"http_{response.status_code}: {response.text[:200]}")
        try:
            body = response.json()
        except ValueError as exc:
            raise ListingUnavailable("unparseable listing body") from exc
        items = extract(body, spec.items_field) if isinstance(body, dict) else body
        if not isinstance(items, list):
            raise ListingUnavailable(f"the listing has no list at {spec.items_field!r}")
        listing.pages += 1
        listing.documents.extend(i for i in items if isinstance(i, dict))
        if spec.next_cursor_field:
            nxt = extract(body, spec.next_cursor_field)
        elif spec.cursor_from_last_item and items:
            nxt = extract(items[-1], spec.cursor_from_last_item)
        else:
            nxt = None
        has_more = bool(extract(body, spec.has_more_field)) if spec.has_more_field else nxt is not None
        if not has_more or nxt is None or not items or str(nxt) == cursor:
            return
        cursor = str(nxt)
    raise ListingUnavailable(f"more than {MAX_PAGES} pages: listing cut short")


def _key_field(action: ActionConfig) -> str:
    return (action.lookup.key_field if action.lookup and action.lookup.key_field else None) or DEFAULT_KEY_FIELD


def _doc_status(action: ActionConfig, doc: dict[str, Any]) -> Any:
    return extract(doc, action.lookup.status_field if action.lookup else "status")


def compare(
    session: Session, actions: ActionsFile, listing: Listing, *, since: dt.datetime, now: dt.datetime
) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Discrepancies between one listing and the ledger; also how many successes were too recent."""
    first = actions.action(listing.actions[0])
    key_field, ref_field = _key_field(first), first.result_reference or "id"
    out: dict[str, list[dict[str, Any]]] = {
        "record_without_document": [],
        "document_without_record": [],
        "duplicates": [],
    }
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    refs: set[str] = set()
    unkeyed: list[dict[str, Any]] = []
    for doc in listing.documents:
        key, ref = extract(doc, key_field), extract(doc, ref_field)
        if ref is not None:
            refs.add(str(ref))
        if key is None:
            unkeyed.append(doc)
        else:
            by_key[str(key)].append(doc)

    # Ledger -> provider: every success must have its document.
    too_recent = 0
    lookups = [actions.action(a).lookup for a in listing.actions]
    settle_s = max((spec.settle_s for spec in lookups if spec is not None), default=0.0)
    for rec in ledger.records_with_effect(session, actions=listing.actions, since=since):
        if listing.tenant is not None and rec.tenant != listing.tenant:
            continue  # another tenant's account: its own listing answers for it
        if rec.provider_key in by_key or (rec.result_reference is not None and rec.result_reference in refs):
            continue
        if rec.finished_at is not None and (now - rec.finished_at).total_seconds() < settle_s:
            too_recent += 1  # inside the provider's index lag: absence proves nothing yet
            continue
        out["record_without_document"].append(rec.as_json() | {"target": listing.target})

    # Provider -> ledger: every document must belong to an operation that holds the effect.
    known = ledger.records_by_key(session, actions=listing.actions, keys=by_key)
    by_ref = ledger.records_by_reference(session, actions=listing.actions, references=refs)
    if listing.tenant is not None:  # a document of this account is never another tenant's record
        known = {k: [r for r in recs if r.tenant == listing.tenant] for k, recs in known.items()}
        by_ref = {k: r for k, r in by_ref.items() if r.tenant == listing.tenant}
    for key, docs in sorted(by_key.items()):
        records = known.get(key, [])
        tenant = listing.tenant or (records[0].tenant if len({r.tenant for r in records}) == 1 else None)
        for doc in docs:
            ref = extract(doc, ref_field)
            mine = [r for r in records if r.status in ledger.EFFECT_STATUSES]
            if mine or (ref is not None and str(ref) in by_ref):
                continue
            why = (
                "no operation with this key"
                if not records
                else "no succeeded operation: " + ", ".join(sorted({r.status for r in records}))
            )
            out["document_without_record"].append(
                {
                    "target": listing.target,
                    "tenant": tenant,
                    "actions": listing.actions,
                    "idempotency_key": key,
                    "reference": None if ref is None else str(ref),
                    "status": _doc_status(first, doc),
                    "why": why,
                    "ledger": [r.as_json() for r in records],
                }
            )
        if len(docs) > 1:
            out["duplicates"].append(
                {
                    "target": listing.target,
                    "tenant": tenant,
                    "actions": listing.actions,
                    "idempotency_key": key,
                    "count": len(docs),
                    "references": [None if extract(d, ref_field) is None else str(extract(d, ref_field)) for d in docs],
                }
            )
    for doc in unkeyed:
        ref = extract(doc, ref_field)
        if ref is not None and str(ref) in by_ref:
            continue
        out["document_without_record"].append(
            {
                "target": listing.target,
                "tenant": listing.tenant,
                "actions": listing.actions,
                "idempotency_key": None,
                "reference": None if ref is None else str(ref),
                "status": _doc_status(first, doc),
                "why": f"the document carries no {key_field}",
                "ledger": [],
            }
        )
    return out, too_recent


def same_effect_rules(actions: ActionsFile) -> dict[str, tuple[str, ...] | None]:
    """Per action that names its business object: its ``report.same_effect_when``, or None (``object``)."""
    return {
        name: tuple(a.report.same_effect_when) if a.report is not None else None
        for name, a in sorted(actions.actions.items())
        if a.report is not None or a.business_object is not None
    }


def build_report(
    session: Session,
    actions: ActionsFile,
    *,
    since: dt.datetime,
    now: dt.datetime,
    http: HttpConnector | None = None,
    same_object_window_s: float = DEFAULT_WINDOW_S,
) -> dict[str, Any]:
    """The whole report as the documented JSON object (see the module docstring)."""
    listings, unlisted = group_listings(actions)
    own_http = http is None
    connector = http or HttpConnector(actions)
    discrepancies: dict[str, list[dict[str, Any]]] = {
        "record_without_document": [],
        "document_without_record": [],
        "duplicates": [],
    }
    too_recent = 0
    try:
        for listing in listings:
            oldest = ledger.records_with_effect(session, actions=listing.actions, since=since)
            start = min([since] + [r.created_at for r in oldest if r.created_at is not None])
            try:
                client = connector.client_for(listing.target, listing.tenant)
                read_listing(client, listing, since_epoch_s=start.timestamp() - LISTING_SLACK_S)
            except ListingUnavailable as exc:
                listing.error = str(exc)
                continue
            found, recent = compare(session, actions, listing, since=since, now=now)
            too_recent += recent
            for kind, items in found.items():
                discrepancies[kind].extend(items)
    finally:
        if own_http:
            connector.close()

    # The provider's webhook events that no operation took (outbox/reads/webhook_events.py), but those
    # a listing found already.
    listed = {(d["target"], d["reference"]) for d in discrepancies["document_without_record"] if d["reference"]}
    discrepancies["document_without_record"] += [
        d for d in webhook_documents(session, since=since) if (d["target"], d["reference"]) not in listed
    ]
    discrepancies["state_contradictions"] = ledger.state_contradictions(session, since=since)
    by_object, figures = report_figures(
        session, rules=same_effect_rules(actions), since=since, window_s=same_object_window_s
    )
    retries: dict[str, dict[str, int]] = defaultdict(lambda: {"retries": 0, "billable": 0})
    for action_name, counts in ledger.retries_by_action(session, since=since).items():
        cfg = actions.actions.get(action_name)
        target = cfg.target if cfg is not None else f"(unknown action {action_name})"
        for k, v in counts.items():
            retries[target][k] += v
    return {
        "version": REPORT_VERSION,
        "generated_at": now.isoformat(),
        "since": since.isoformat(),
        "discrepancy_count": sum(len(v) for v in discrepancies.values()),
        "by_tenant": _by_tenant(discrepancies),
        "complete": all(listing.error is None for listing in listings),
        "discrepancies": discrepancies,
        "listings": [listing.describe() for listing in listings],
        "actions_without_listing": unlisted,
        "too_recent": too_recent,
        "possible_duplicates_by_object": by_object,
        "health": {
            "operations": ledger.operations_in_window(session, since=since),
            "duplicate_effects": sum(d["count"] - 1 for d in discrepancies["duplicates"]),
            "failure_attributability": ledger.failure_attributability(session, since=since),
            "auto_recovery": ledger.auto_recovery(session, since=since),
            "handoffs": ledger.handoff_figures(session, since=since),
            "retries_by_target": dict(sorted(retries.items())),
            **figures,
        },
    }


def _by_tenant(discrepancies: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, int]]:
    """Discrepancy counts per tenant ("(unknown)": a document no operation claims)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {kind: 0 for kind in discrepancies})
    for kind, items in discrepancies.items():
        for item in items:
            out[item.get("tenant") or "(unknown)"][kind] += 1
    return dict(sorted(out.items()))


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True, default=str)
