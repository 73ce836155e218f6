"""Benchmarks (``python -m bench.X``; bench/README.md).

They start the workers the tests' harness starts, but cold: the CPU split (tests/loads/cpu_split.py)
tells processes apart by their command line, and a worker forked from the tests' fork server
(tests/spawn.py) would be counted as neither a worker nor a reconciler."""

import os

os.environ.setdefault("OUTBOX_TEST_SPAWN", "cold")
