"""The benchmarks' CPU split (tests/loads/cpu_split.py): the machine's counters read from
``/proc/stat``, and the context switches by kind of process over a span in which this process
computes and sleeps."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.loads.cpu_split import CpuSplit, parse_proc_stat

TICK = os.sysconf("SC_CLK_TCK")

# A 4.x kernel's first lines: user nice system idle iowait irq softirq steal guest guest_nice.
SAMPLE = """cpu  1000 20 300 5000 40 6 70 80 900 10
cpu0 500 10 150 2500 20 3 35 40 450 5
intr 123456 1 2 3
ctxt 987654
btime 1700000000
"""


def test_proc_stat_is_read_field_by_field() -> None:
    m = parse_proc_stat(SAMPLE)
    assert m["context_switches"] == 987654
    assert m["busy_s"] == pytest.approx((1000 + 20 + 300 + 6 + 70) / TICK)  # guest is inside user already
    assert m["idle_s"] == pytest.approx((5000 + 40) / TICK)
    assert m["steal_s"] == pytest.approx(80 / TICK)


def test_a_short_cpu_line_reads_as_zeros_not_an_error() -> None:
    m = parse_proc_stat("cpu  10 0 5 100\nctxt 7\n")
    assert m["steal_s"] == 0 and m["context_switches"] == 7
    assert m["busy_s"] == pytest.approx(15 / TICK)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
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
    # The machine was busy at least while this process was: busy and idle not read the wrong way round.
    assert split.machine["busy_s"] >= 0.8 * split.seconds[mine]
    assert split.machine["context_switches"] >= 20
