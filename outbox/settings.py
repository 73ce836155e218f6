"""Settings: one object built from ``OUTBOX_*`` environment variables at start-up.

The defaults need no server: a SQLite ledger in ``./.outbox/`` and (for workers) a broker that
needs no server. Production sets ``OUTBOX_DATABASE_URL=postgresql+psycopg://...`` and Redis URLs.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox.errors import ConfigError

DEFAULT_DATA_DIR = Path(".outbox")
SUPPORTED_SCHEMES = ("sqlite", "sqlite+pysqlite", "postgresql+psycopg")

# A weight above this is a typo rather than a share (one tenant 1000 times another's).
MAX_WEIGHT = 1000.0
WEIGHTS_FORMAT = "tenant=weight pairs separated by commas, e.g. 'acme=3,globex=1' (weights > 0 and <= 1000)"


class LogFormat(StrEnum):
    TEXT = "text"  # one readable line per record (the default)
    JSON = "json"  # one JSON object per line, every ``extra`` field kept (workers/ground/logs.py)


def log_format_from(value: str | None) -> LogFormat:
    """OUTBOX_LOG_FORMAT's value (unset or empty: text); ConfigError naming the variable otherwise."""
    try:
        return LogFormat((value or LogFormat.TEXT.value).strip().lower())
    except ValueError:
        choices = " or ".join(f.value for f in LogFormat)
        raise ConfigError(f"OUTBOX_LOG_FORMAT: {value!r} is not a log format; use {choices}") from None


class FairnessMode(StrEnum):
    TENANT = "tenant"  # tenants in turn, by weight; priority then age inside a tenant
    OFF = "off"  # priority then age, whoever the tenant


def parse_weights(text: str) -> dict[str, float]:
    """``acme=3,globex=1`` as {tenant: weight}; ValueError saying the expected form otherwise."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        tenant, sep, value = part.partition("=")
        tenant = tenant.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not tenant or not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"{part.strip()!r} is not tenant=weight; use {WEIGHTS_FORMAT}")
        if tenant in weights:
            raise ValueError(f"tenant {tenant!r} is weighted twice; use {WEIGHTS_FORMAT}")
        weights[tenant] = weight
    return weights


LEDGER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
LEDGERS_FORMAT = (
    "name=url pairs separated by commas, e.g. 'shop=postgresql+psycopg://db1/shop,crm=postgresql+psycopg://db2/crm' "
    "(names: lower-case letters, digits, - and _, at most 40)"
)


def check_database_url(value: str) -> str:
    """A ledger URL of a supported scheme; ValueError saying which to use otherwise."""
    if value.startswith(("postgresql://", "postgres://")):
        raise ValueError("use postgresql+psycopg://... (the psycopg 3 driver)")
    if value and value.split("://", 1)[0] not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"unsupported scheme {value.split('://', 1)[0]!r}; use one of "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        )
    return value


def parse_ledgers(text: str) -> dict[str, str]:
    """``shop=url,crm=url`` as {name: url} in the order given; ValueError naming the pair at fault
    and the form expected otherwise."""
    ledgers: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, url = part.strip().partition("=")
        name, url = name.strip(), url.strip()
        if not sep or "://" not in url or not LEDGER_NAME.match(name):
            raise ValueError(f"{part.strip()!r} is not name=url; use {LEDGERS_FORMAT}")
        try:
            check_database_url(url)
        except ValueError as exc:
            raise ValueError(f"ledger {name!r}: {exc}") from None
        if name in ledgers:
            raise ValueError(f"ledger {name!r} is named twice; use {LEDGERS_FORMAT}")
        if url in ledgers.values():
            other = next(n for n, u in ledgers.items() if u == url)
            raise ValueError(f"ledgers {other!r} and {name!r} are the same database; name each ledger once")
        ledgers[name] = url
    return ledgers


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="ignore")

    data_dir: Path = Field(default=DEFAULT_DATA_DIR, description="folder of the embedded default")
    database_url: str = Field(default="", description="SQLAlchemy URL of the ledger")
    # One worker fleet draining several ledgers (each application keeps its outbox in its own
    # database): name=url pairs. Set, the workers, the relay and beat's tasks serve every one of
    # them, each with its own doorbell queues (dispatch.<name>, outcome_unknown.<name>), claims and
    # relay; one that is down holds back only its own operations. OUTBOX_DATABASE_URL stays the one
    # ledger of every other command (the CLI, the API, the console). Empty: that one ledger only.
    database_urls: str = Field(default="", description="name=url,... the ledgers one worker fleet drains")
    # A lease longer than any single HTTP attempt (timeout_s + connect_timeout_s) plus the
    # finalize write, so a live worker never loses its lease mid-call; short enough that a
    # crashed worker's operation reaches the reconciler within a minute.
    lease_s: float = Field(default=60.0, gt=0)
    default_tenant: str = Field(default="default", min_length=1)

    # Workers (workers/). Empty broker URL = the embedded broker (kombu's SQLAlchemy transport on
    # a SQLite file next to the ledger): no server needed. Production: redis://...
    broker_url: str = Field(default="", description="Celery broker URL")
    # Prefix for every broker key in Redis: several deployments (or test runs) share one Redis.
    broker_key_prefix: str = Field(default="", description="kombu global_keyprefix for Redis")
    # Shared circuit-breaker state; empty = process-local breakers (embedded default).
    redis_url: str = Field(default="", description="Redis URL for breaker state")
    # Declared limits (rate_limit, max_in_flight) are counted in that Redis for the whole fleet. While
    # it is away each process keeps to its share: the limit divided by the processes Redis last
    # counted, or by this before any count was seen (a guess of the fleet's size; higher is safer).
    pacing_fallback_processes: int = Field(default=4, ge=1)
    # Evidence sink; empty = the ledger's own evidence table, written with the success itself.
    evidence_url: str = Field(default="", description="separate database for evidence records")
    # Fail closed for every action (as `evidence: {required: true}` does for one): while the separate
    # evidence store is down nothing is sent; operations wait (waiting_for = evidence), unspent.
    evidence_required: bool = Field(default=False, description="send nothing while the evidence store is down")
    actions_file: Path | None = Field(default=None, description="YAML actions/targets file")
    # Operation ids per dispatch doorbell. More = fewer messages and commits per operation (the
    # batch is claimed in one statement, called concurrently, finalized in one transaction); the
    # cost: a worker that crashes mid-batch sends the whole batch through lease expiry and
    # reconciliation instead of one operation. 20, half of max_in_flight: a process holds two
    # doorbells' worth. At 10 a stream of ~650 intents/s filled every doorbell before the relay's
    # linger ended (20 ids per 30 ms window), so the batch, not the linger, set the messages,
    # claims and finalizes per operation (docs/how-to/tune.md has the figures).
    doorbell_batch: int = Field(default=20, ge=1, le=100)
    # Operations claimed and not yet finalized, per worker process. Calls run off the doorbell
    # task's thread (workers/dispatch/in_flight.py), so a slow call holds only itself; this bounds how many
    # a process holds at once. A full process takes no doorbell until room frees up (backpressure).
    max_in_flight: int = Field(default=40, ge=1, le=1000)
    # How a dispatch claim shares what is due (outbox/ledger/fairness.py): 'tenant' serves the
    # tenants with work due in turn (one tenant's backlog cannot hold another's new intent behind
    # it); 'off' takes the highest priority, then the oldest, whoever the tenant.
    fairness: FairnessMode = Field(default=FairnessMode.TENANT)
    # Shares of the claim by tenant, 'acme=3,globex=1'; a tenant not named weighs 1.
    tenant_weights: str = Field(default="", description=WEIGHTS_FORMAT)
    task_events: bool = Field(default=False, description="Celery task events from the start (Flower)")
    worker_concurrency: int = Field(default=2, ge=1, le=64)
    # soft < hard < lease < visibility (checked at worker start-up): Celery kills a stuck task
    # before its lease can expire, and Redis redelivers only after the lease has expired.
    soft_time_limit_s: float = Field(default=30.0, gt=0)
    time_limit_s: float = Field(default=45.0, gt=0)
    visibility_timeout_s: float = Field(default=3600.0, gt=0)
    # The relay wakes on NOTIFY (PostgreSQL); this poll is the backstop and SQLite's only signal.
    relay_poll_s: float = Field(default=0.5, gt=0)
    # A notified id is published at once when the relay has been quiet this long; under load the
    # relay gathers the ids of this window into doorbells of up to doorbell_batch ids (fewer broker
    # messages, claims and finalizes per operation, at most this much added latency). 0 = publish
    # every wake-up at once. At 0.01 a stream slowed by scarce CPU came in doorbells of a few ids,
    # and per-doorbell costs grew per operation: the workers' CPU per operation rose a third.
    relay_linger_s: float = Field(default=0.03, ge=0, le=1)
    # A published doorbell not acted on for this long is assumed lost and published again, but
    # only while the broker holds no dispatch doorbell (queued is not lost: workers/relay/loop.py).
    republish_after_s: float = Field(default=30.0, gt=0)
    # Dispatch doorbells the relay lets the broker hold at once. A doorbell claims whatever is due
    # (up to doorbell_batch), so this only has to keep every worker process busy between two relay
    # ticks; the backlog itself waits in the ledger, never as a flood of messages.
    relay_max_queued: int = Field(default=100, ge=1)
    # The reconciler's own budget (lookups are cheap and safe): this many lookups, re-checks
    # backing off up to reconcile_max_delay_s, before a person is asked. 12 lookups with a 60 s
    # cap is about ten minutes of provider outage; tests shrink both to stay fast.
    reconcile_max_lookups: int = Field(default=12, ge=1)
    reconcile_max_delay_s: float = Field(default=60.0, gt=0)
    # A handoff that the provider's answer could settle keeps being looked up (outbox/evidence/checks.py):
    # first after handoff_recheck_first_s, then as long again as it has been open, at most
    # handoff_recheck_max_s apart, until the provider's key retention ends (without provider keys:
    # handoff_recheck_without_keys_s from the first attempt).
    handoff_recheck_first_s: float = Field(default=60.0, gt=0)
    handoff_recheck_max_s: float = Field(default=6 * 3600.0, gt=0)
    handoff_recheck_without_keys_s: float = Field(default=7 * 86400.0, gt=0)
    # A handoff nobody has taken for longer than this counts in outbox_handoffs_unowned (and its alert):
    # half an hour is long for a customer waiting on a refund, and short of a shift change.
    handoff_unowned_alert_s: float = Field(default=1800.0, gt=0)
    # The reconciliation report's "possible duplicates by business object": two succeeded operations
    # on one object under different keys, created at most this far apart (outbox/reads/same_effect.py).
    # A day catches a caller's retry after an overnight outage; ``report --same-object-window`` overrides.
    report_same_object_window_s: float = Field(default=86400.0, gt=0)
    # Metrics (docs/reference/metrics.md). metrics_port: a worker's main process (or the relay) serves
    # its own process metrics on this port; 0 = off (``agent-outbox metrics`` serves them when
    # every process shares one PROMETHEUS_MULTIPROC_DIR on one host).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Terminal operations are counted over this window only: an exact count of all succeeded
    # rows is a scan of the whole table at every scrape; a window is a range of the
    # (status, updated_at) index. One hour matches a typical dashboard range.
    metrics_terminal_window_s: float = Field(default=3600.0, gt=0)
    # outbox_tenant_oldest_due_age_seconds{tenant} for the tenants whose due work waited longest, at
    # most this many (fairness, seen per tenant); 0, the default, exports no tenant label at all:
    # a label per tenant is a series per tenant, which the operator must choose to pay for.
    metrics_tenants: int = Field(default=0, ge=0, le=1000)
    # text (default) or json: one JSON object per line with every ``extra`` field (operation id,
    # tenant, action, attempt, fencing token), the trace and span ids, the event. Read by each
    # process as it sets up logging (workers/ground/logs.py), before Settings exist.
    log_format: LogFormat = LogFormat.TEXT
    # Liveness of the processes without HTTP (relay, workers, beat): each touches this file from
    # its own loop; `agent-outbox health --heartbeat` checks its age (workers/ground/heartbeat.py).
    heartbeat_file: str = ""
    # otel: OpenTelemetry traces (the otel extra; OTEL_* variables configure it), off: none; unset:
    # on when OTEL_TRACES_EXPORTER or an OTLP endpoint is set (workers/ground/tracing.py).
    tracing: str = ""
    # ``agent-outbox purge`` removes the arguments and provider responses of terminal operations
    # older than this (outbox/privacy/retention.py). Never shorter than the longest provider key retention
    # of the actions file (checked at start-up): until the provider forgets a key, the arguments
    # are what a person needs to answer for it.
    args_retention_s: float = Field(default=30 * 86400.0, gt=0)
    # The HTTP API (``agent-outbox serve``): requests per second per key (burst twice that), and
    # the largest request body accepted (413 above it).
    api_rate_per_s: float = Field(default=50.0, gt=0)
    api_max_body_bytes: int = Field(default=1_048_576, gt=0)
    # Past this many operations a tenant's fleet still owes work (not yet sent, or outcome unknown),
    # a new intent is answered 429 with Retry-After, nothing stored; a resubmit is still answered.
    # 0 (default): no limit. Size it as the backlog the fleet settles within its callers' patience
    # (e.g. 60 s of its settle rate).
    api_max_backlog: int = Field(default=0, ge=0)
    # Database connections each API server process (and each `mcp --http`) holds at most, opened as
    # requests need them and then kept: a connection opened and closed per request costs PostgreSQL a
    # new backend each time (SQLAlchemy's default pool kept 5 and closed the rest on return: with 8
    # clients, one new connection per 9 requests). Requests beyond it wait for one, up to 30 s: then
    # the HTTP API answers 503 ``busy`` with Retry-After (the request not carried out), and
    # `mcp --http` answers the tool call "Busy" (an error result: call again).
    api_db_connections: int = Field(default=15, ge=1, le=1000)
    # Signs the console's session cookies (and their CSRF tokens). Unset: a random secret per server
    # process (sessions end when it restarts; set it when serving with several processes).
    console_secret: str | None = Field(default=None, min_length=32)
    console_session_s: float = Field(default=8 * 3600.0, gt=0)
    # The session cookie's Secure flag. Unset: on, except for a console reached on localhost (plain
    # http there is fine); off only if you must serve it over plain http elsewhere (not recommended).
    console_cookie_secure: bool | None = None
    # Where people open the console (https://outbox.example): the approval page an MCP task awaiting
    # approval points to (producer/agents/mcp_tasks.py). Empty: the MCP request's own base URL.
    public_url: str = Field(default="", description="base URL of the console, as people reach it")

    @field_validator("database_url", "evidence_url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        return check_database_url(value)

    @field_validator("database_urls")
    @classmethod
    def _ledgers(cls, value: str) -> str:
        parse_ledgers(value)  # ValueError: names the pair at fault and the form expected
        return value

    @property
    def ledger_urls(self) -> dict[str | None, str]:
        """The ledgers this process's fleet drains, {name: url}: OUTBOX_DATABASE_URLS's, or the one
        ledger (name None: the plain queues dispatch and outcome_unknown) without it."""
        named: dict[str | None, str] = {name: url for name, url in parse_ledgers(self.database_urls).items()}
        return named or {None: self.resolved_database_url}

    @field_validator("broker_url", "redis_url")
    @classmethod
    def _broker_scheme(cls, value: str) -> str:
        if value and value.split("://", 1)[0] not in ("redis", "rediss", "sqla+sqlite", "memory"):
            raise ValueError("use redis://host:port/db (or leave empty for the embedded default)")
        return value

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str) -> str:
        if value and not value.startswith(("https://", "http://")):
            raise ValueError("use the console's base URL, e.g. https://outbox.example (or leave empty)")
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _weights(cls, value: str) -> str:
        parse_weights(value)  # ValueError: says what is wrong and the form expected
        return value

    @property
    def tenant_weight_map(self) -> dict[str, float]:
        """OUTBOX_TENANT_WEIGHTS as {tenant: weight} (outbox/ledger/fairness.py)."""
        return parse_weights(self.tenant_weights)

    @field_validator("actions_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no such file: {value}")
        return value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'outbox.ledger.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        if self.broker_url:
            return self.broker_url
        return f"sqla+sqlite:///{(self.data_dir / 'broker.db').resolve()}"

    @property
    def embedded_broker(self) -> bool:
        return self.resolved_broker_url.startswith("sqla+")


def load_settings() -> Settings:
    """Build Settings from the environment, turning validation errors into one clear message."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            problems.append(f"OUTBOX_{field.upper()}: {err['msg']}")
        raise ConfigError("bad settings: " + "; ".join(problems)) from exc
