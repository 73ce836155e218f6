"""The tenants' walk: the parts of the PostgreSQL claim and relay statements that share due work
among tenants (outbox/ledger/drivers/pg_statements.py assembles them; outbox/ledger/fairness.py
says what is shared and why). Plain SQL in psycopg's catalogue form, ``:name`` parameters.
"""

from __future__ import annotations

from outbox.ledger.states import Status

IDS_IN = " AND id = ANY(CAST(:operation_ids AS varchar[]))"
IDS_NOT_IN = " AND NOT (id = ANY(CAST(:operation_ids AS varchar[])))"
LEASE_FREE = " AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())"
NOT_DISPATCHED = f"status = '{Status.NOT_DISPATCHED.value}'"
# A tenant's due rows in the order it is served (models.py: ix_outbox_operations_fair_due).
CLAIM_ORDER = "priority DESC, next_attempt_at"

# Tenants one fair claim looks at, after the cursor (wrapping around): each costs one probe of the
# fair index, and a claim of up to 100 rows rarely serves more than a few dozen tenants.
FAIR_TENANTS = 32

# The tenants with rows due, in the order they are served this time: those after the cursor tenant
# (:after_tenant, the last one this process served), then from the first up to the cursor; at most
# FAIR_TENANTS. One probe of the fair index per tenant (a loose index scan), not a scan of every row
# of a big tenant; a probe passes over a tenant's rows not due yet (never walking tenants with none
# due, so those past the FAIR_TENANTS-th are reached). n: the tenant's place in this claim's round.
DUE_NOW = "next_attempt_at <= statement_timestamp()"
FAIR_WALK = f"""
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM {{operations}} WHERE {NOT_DISPATCHED} AND {DUE_NOW}
            AND tenant > CAST(:after_tenant AS varchar) ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM {{operations}} o WHERE o.{NOT_DISPATCHED} AND o.{DUE_NOW}
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < {{tenants}}
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM {{operations}} WHERE {NOT_DISPATCHED} AND {DUE_NOW}
            AND tenant <= CAST(:after_tenant AS varchar) ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM {{operations}} o WHERE o.{NOT_DISPATCHED} AND o.{DUE_NOW} AND o.tenant > w.tenant
              AND o.tenant <= CAST(:after_tenant AS varchar) ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < {{tenants}}
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= {{tenants}}
)"""
WEIGHTED = """
weighted AS (
    SELECT w.tenant, w.n, coalesce((SELECT u.weight FROM unnest(CAST(:weight_tenants AS varchar[]),
        CAST(:weights AS float8[])) AS u(tenant, weight) WHERE u.tenant = w.tenant LIMIT 1), 1) AS weight
    FROM walk w
)"""

# Each walked tenant's due rows in its order, up to the whole claim (a lone tenant fills it),
# locked as they are read; a doorbell's wanted rows of that tenant take its first turns. Then every
# candidate ranked ({ranking}): fair, by its turn over its tenant's weight, ties in the round's
# tenant order, so each tenant with work due gets its share of the claim and one tenant's backlog
# cannot fill it; unfair, wanted rows first, then by priority and age whoever the tenant (each
# tenant's first rows hold the claim's first rows, the walk's tenants all walked).
# ix_outbox_operations_due cannot give a tenant's order (it is by time alone), so no plan reads it
# filtering on the tenant; when it could, a generic plan did, statistics taken before a second
# tenant's first rows making the tenant look unselective: 15 ms a claim behind a 20k backlog.
FAIR_DUE = f"""
wanted AS (
    SELECT id, tenant, priority, next_attempt_at,
        row_number() OVER (PARTITION BY tenant ORDER BY {CLAIM_ORDER}) AS turn FROM (
        SELECT id, tenant, priority, next_attempt_at FROM {{operations}}
        WHERE {NOT_DISPATCHED} AND next_attempt_at <= clock_timestamp(){IDS_IN}
        ORDER BY {CLAIM_ORDER}  -- more ids than wanted: the first in claim order, not whichever the plan meets
        LIMIT {{wanted}}
        FOR UPDATE SKIP LOCKED) given
), candidates AS (
    SELECT id, tenant, turn, 1 AS given, priority, next_attempt_at FROM wanted
    UNION ALL
    SELECT c.id, t.tenant, c.turn + coalesce((SELECT count(*) FROM wanted WHERE wanted.tenant = t.tenant), 0),
        0, c.priority, c.next_attempt_at
    FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at, row_number() OVER (ORDER BY {CLAIM_ORDER}) AS turn FROM (
            SELECT id, priority, next_attempt_at FROM {{operations}} o
            WHERE o.{NOT_DISPATCHED} AND o.tenant = t.tenant AND o.{DUE_NOW}{{not_wanted}}
            ORDER BY {CLAIM_ORDER}
            LIMIT {{take}}
            FOR UPDATE SKIP LOCKED) due_of_tenant
    ) c
), due AS (
    SELECT c.id, row_number() OVER (ORDER BY {{ranking}}) AS rank
    FROM candidates c LEFT JOIN weighted wt ON wt.tenant = c.tenant
    ORDER BY rank
    LIMIT {{take}}
)"""
FAIR_RANKING = "c.turn / coalesce(wt.weight, 1), c.tenant <= CAST(:after_tenant AS varchar), c.tenant"
UNFAIR_RANKING = "c.given DESC, c.priority DESC, c.next_attempt_at"
