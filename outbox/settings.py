"""Settings: one object built from ``OUTBOX_*`` environment variables at start-up.

The defaults need no server: a SQLite ledger in ``./.outbox/`` and (for workers) a broker that
needs no server. Production sets ``OUTBOX_DATABASE_URL=postgresql+psycopg://...`` and Redis URLs.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox.errors import ConfigError

DEFAULT_DATA_DIR = Path(".outbox")
SUPPORTED_SCHEMES = ("sqlite", "sqlite+pysqlite", "postgresql+psycopg")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="ignore")

    data_dir: Path = Field(default=DEFAULT_DATA_DIR, description="folder of the embedded default")
    database_url: str = Field(default="", description="SQLAlchemy URL of the ledger")
    # A lease longer than any single HTTP attempt (timeout_s + connect_timeout_s) plus the
    # finalize write, so a live worker never loses its lease mid-call; short enough that a
    # crashed worker's operation reaches the reconciler within a minute.
    lease_s: float = Field(default=60.0, gt=0)
    default_tenant: str = Field(default="default", min_length=1)

    @field_validator("database_url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if value and value.split("://", 1)[0] not in SUPPORTED_SCHEMES:
            raise ValueError(
                f"unsupported scheme {value.split('://', 1)[0]!r}; use one of "
                + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
            )
        if value.startswith("postgresql://") or value.startswith("postgres://"):
            raise ValueError("use postgresql+psycopg:// (psycopg 3 driver)")
        return value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'outbox.db').resolve()}"


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
