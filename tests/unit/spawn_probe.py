"""Run by tests/unit/test_spawn.py, forked and cold: prints what a program can see of how it was started."""

import json
import os
import signal
import sys

if __name__ == "__main__":
    if sys.argv[1:] == ["exit"]:
        sys.exit(int(os.environ["PROBE_EXIT"]))
    line = sys.stdin.readline()
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "path0": sys.path[0],
                "env": os.environ.get("PROBE_ENV"),
                "stdin": line,
                "signals": {
                    s.name: str(signal.getsignal(s))
                    for s in signal.Signals
                    if s not in (signal.SIGKILL, signal.SIGSTOP)
                },
                "main": __name__,
                "pgrp_is_own": os.getpgrp() == os.getpid(),
            }
        )
    )
    print("to stderr", file=sys.stderr)
