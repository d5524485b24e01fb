"""The soak in short, through memtop's public surface (issue "Safe inside a real training run").

Real torch trainers under `memtop run` (AdamW, `zero_grad(set_to_none=True)`), viewers asking
for `breakdown`, `snapshot`, `cleanup` and `reset_peak` as fast as the agent allows, for 60 s.
The race that once crashed trainers (an off-thread walk of the optimizer's tensors) must be
seen by the same harness, or a pass would mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


def _soak(*args: str, timeout: float) -> dict:  # type: ignore[type-arg]
    done = subprocess.run(
        [sys.executable, str(SOAK), "--device", "cpu", "--width", "128", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The viewers' window opens once the trainer steps (bench/soak.py waits for it), so torch's
# import, seconds on a loaded box, is no longer part of it.
SECONDS = 15


@pytest.mark.slow
def test_trainers_survive_hammering_viewers():
    # No control group: the step-rate ratio is bench/soak.py's to measure, not the suite's.
    report = _soak(
        "--trainers", "1", "--viewers", "2", "--seconds", str(SECONDS), "--no-control",
        timeout=240,
    )  # fmt: skip
    assert report["crashes"] == 0, report["crash_reasons"]
    # Breakdowns were measured at the step boundary, and every one was right.
    # An optimizer walk at most every 10 s (BREAKDOWN_MIN_INTERVAL_S): one at once and one 10 s
    # later for each of the 2 viewers in the 13 s the viewers run.  (Before the window waited
    # for the trainer's first step, 12 s under two suites at once saw none: torch's import took
    # most of it.)
    assert report["breakdowns_checked"] >= 2
    assert report["breakdowns_wrong"] == 0, report["breakdown_wrong_example"]
    ok = report["replies_ok"]
    # The polite 10 Hz sampler beside the hammering connection is still served.  How much of
    # its 10 requests a second get through varies with the box: 52-97 % over six 60 s runs on
    # this repo's 2-core CI machine, with this viewer client and the one before it alike (a
    # late sampler catches up in bursts, and bursts over 12 requests/s may be governed).  A
    # dashboard asks once a second and is never governed.
    assert ok.get("sample:ok", 0) > 2 * 10 * SECONDS * 0.4 and ok.get("cleanup:ok", 0) >= 1
    assert ok.get("snapshot:ok", 0) >= 1 and ok.get("reset_peak:ok", 0) >= 1
    # Threads and fds stay flat: no thread or descriptor per request.  Allowed: the one I/O
    # worker thread (started on first use), the 2 viewers x 2 connections, a snapshot's file.
    (start,), (peak,) = report["threads_fds_start"], report["threads_fds_max"]
    assert peak[0] <= start[0] + 1 and peak[1] <= start[1] + 2 * 2 + 2


@pytest.mark.slow
def test_the_soak_sees_the_race_that_once_crashed_trainers():
    # The same harness, with a thread walking the optimizer's tensors as the old agent did:
    # both trainers (the control's and the agent's) crashed within 5 s in three runs of three.
    # The agent's trainer alone (no control group: a torch trainer less, ~2.5 CPU-s) crashed
    # at its first steps in three runs of three.
    report = _soak(
        "--trainers", "1", "--viewers", "1", "--seconds", "8", "--inject-race", "--no-control",
        timeout=180,
    )  # fmt: skip
    assert report["crashes"] >= 1, report
