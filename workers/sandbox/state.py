"""Everything the sandbox remembers, in memory, in one place so reset() clears all of it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from workers.sandbox.config import Clock, SandboxConfig
from workers.sandbox.effects import EffectsLedger
from workers.sandbox.faults import FaultBook
from workers.sandbox.idempotency import FencingBook, KeyStore
from workers.sandbox.requestlog import RequestLog
from workers.sandbox.store import ObjectStore
from workers.sandbox.webhooks import WebhookBook


@dataclass
class SandboxState:
    config: SandboxConfig = field(default_factory=SandboxConfig)
    initial_config: SandboxConfig = field(default_factory=SandboxConfig)
    clock: Clock = field(default_factory=Clock)
    objects: ObjectStore = field(default_factory=ObjectStore)
    keys: KeyStore = field(default_factory=KeyStore)
    fencing: FencingBook = field(default_factory=FencingBook)
    effects: EffectsLedger = field(default_factory=EffectsLedger)
    faults: FaultBook = field(default_factory=FaultBook)
    requests: RequestLog = field(default_factory=lambda: RequestLog(100_000))
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    webhooks: WebhookBook = field(default_factory=WebhookBook)

    @classmethod
    def create(cls, config: SandboxConfig, seed: int | None = None) -> SandboxState:
        initial = SandboxConfig(**vars(config))
        state = cls(config=config, initial_config=initial, faults=FaultBook(default_seed=seed))
        state.requests.resize(config.request_log_max)
        return state

    def reset(self, keep_faults: bool = False) -> None:
        """Back to start-up settings with no objects, keys, effects, request log (or faults)."""
        self.config.__dict__.update(vars(self.initial_config))
        self.clock.offset_s = 0.0
        self.objects = ObjectStore()
        self.keys = KeyStore()
        self.fencing = FencingBook()
        self.effects = EffectsLedger()
        self.requests.clear()
        self.requests.resize(self.config.request_log_max)
        if not keep_faults:
            self.faults = FaultBook(default_seed=self.faults.default_seed)
        else:
            self.faults.forget_keys()  # a fresh run: every key's next request is its first again
        self.seq = itertools.count(1)
        self.webhooks = WebhookBook()
