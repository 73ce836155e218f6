"""The benchmarks' CPU split (tests/loads/cpu_split.py): the machine's counters and the context
switches by kind of process, over a span in which this process computes and sleeps."""

from __future__ import annotations

import sys
import time

import pytest

from tests.loads.cpu_split import CpuSplit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_span_counts_this_process_cpu_its_switches_and_the_machine_busy() -> None:
    with CpuSplit() as split:
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:
            pass
        for _ in range(20):
            time.sleep(0.002)  # each sleep gives the core up: a voluntary context switch

    mine = "bench process (submitters)"  # this process's kind (cpu_split._kind)
    assert split.seconds[mine] >= 0.15
    assert split.switches[mine] >= 20
    assert split.machine["busy_s"] >= 0.15
    assert split.machine["context_switches"] >= 20
    assert split.machine["steal_s"] >= 0
