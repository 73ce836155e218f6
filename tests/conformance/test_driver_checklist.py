"""The checklist itself: every member of the driver protocol is exercised by this suite.

A method added to ``LedgerDriver`` (or to the ``HotPath`` it returns) fails this test until a
conformance test calls it, so the drivers' contract never grows a part that only one driver's
callers happen to test.
"""

from __future__ import annotations

import re
from pathlib import Path

from outbox.ledger.drivers.base import HotPath, LedgerDriver

HERE = Path(__file__).parent


def _members(protocol: type) -> set[str]:
    return {n for n in [*vars(protocol), *getattr(protocol, "__annotations__", {})] if not n.startswith("_")}


def test_every_member_of_the_driver_protocol_is_exercised_by_the_conformance_suite():
    suite = "\n".join(p.read_text() for p in HERE.glob("*.py") if p.name != Path(__file__).name)
    called = {m for m in _members(LedgerDriver) if re.search(rf"\bdriver\.{m}\b", suite)}
    called |= {m for m in _members(HotPath) if re.search(rf"\bpath\.{m}\(", suite)}
    assert {"claim", "finalize", "name", "one_statement"} <= _members(LedgerDriver) | _members(HotPath)
    assert sorted((_members(LedgerDriver) | _members(HotPath)) - called) == []
