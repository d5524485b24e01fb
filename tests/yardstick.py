"""A yardstick for the few wall-clock bounds left in tests.

Budgets are measured in bench/ (DESIGN §9); a test only guards against a regression that would
blow a bound (a hostile agent holding `memtop --once` for its full deadline, once per agent).
On a box running the suite in several workers, or two suites at once, every process starts
slower, so a fixed bound fails for reasons that are not the code's.  The yardstick is a control
`memtop --once --json` over an empty socket directory, timed just before: a bound keeps its
quiet-box value and grows with the slowdown the control measured, never shrinks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

# `memtop --once --json` over an empty socket directory on a quiet 2-core box: 0.21-0.24 s.
QUIET_CONTROL_S = 0.3


def control_once_s() -> float:
    """Wall seconds of a `memtop --once --json` that has no agent to ask, now."""
    with tempfile.TemporaryDirectory(prefix="mt-yard-") as empty:
        os.chmod(empty, 0o700)
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "memtop.cli", "--once", "--json"],
            capture_output=True,
            env=dict(os.environ, MEMTOP_SOCKET_DIR=empty),
            timeout=60,
        )
        return time.monotonic() - started


def slowdown(control_s: float) -> float:
    """How many times slower than a quiet box this one is now (1.0 at the least)."""
    return max(1.0, control_s / QUIET_CONTROL_S)


def bound_s(quiet_bound_s: float, control_s: float) -> float:
    """`quiet_bound_s` as it was set on a quiet box, scaled by the slowdown `control_s` shows."""
    return quiet_bound_s * slowdown(control_s)
