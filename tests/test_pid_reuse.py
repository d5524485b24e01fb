"""A reused pid never gets root's signal (issue 36, item 5).

A process that passes its listening agent socket to a child and exits leaves its pid to be
reused; SO_PEERCRED still names that pid.  memtop identifies the process behind a socket by
what cannot be reused: SO_PEERPIDFD (Linux >= 6.5), else the process's start time against the
socket's; and the kill path signals only the process verified (a pidfd, its start time).

The scenario runs for real in a pid namespace of its own (tests/pid_reuse.py), where
ns_last_pid hands the freed pid to `sleep 1000`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="needs root and unshare (a pid namespace whose pids the test can choose)",
    ),
]

SCENARIO = Path(__file__).with_name("pid_reuse.py")


def start(*args: str) -> subprocess.Popen[str]:
    """The scenario, in a pid namespace (and a /proc) of its own, started."""
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(SCENARIO), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(SCENARIO.parent),
    )


@pytest.fixture(scope="module")
def scenarios() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Both scenarios, started at once: most of each is waiting (twice 2.5 s for the start-time
    check's slack), and each has its own pid namespace, so neither sees the other's pids."""
    started: dict[str, subprocess.Popen[str]] = {}
    try:
        if _kernel_has_peer_pidfd():
            started["pidfd"] = start()
        started["no-pidfd"] = start("--no-pidfd")
        yield started
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
            process.communicate()


def scenario(process: subprocess.Popen[str]) -> dict[str, object]:
    stdout, stderr = process.communicate(timeout=120)
    if "unshare failed" in stderr:
        pytest.skip(f"no pid namespace here: {stderr.strip()}")
    assert process.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(str(out["skip"]))
    return out


def _kernel_has_peer_pidfd() -> bool:
    release = os.uname().release.split("-")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (6, 5)
    except (IndexError, ValueError):
        return False


@pytest.mark.skipif(not _kernel_has_peer_pidfd(), reason="SO_PEERPIDFD needs Linux >= 6.5")
def test_a_reused_pid_is_refused_and_never_signalled(
    scenarios: dict[str, subprocess.Popen[str]],
) -> None:
    out = scenario(scenarios["pidfd"])
    # --once: not the sleep shown as a trainer, but a refusal that says why.
    (row,) = out["once"]  # type: ignore[misc]
    assert row["state"] == "refused", row
    assert "has exited" in row["error"] and "another process" in row["error"], row
    kill = out["kill_reused"]
    assert kill["error"] and not kill["message"], kill  # type: ignore[index]
    assert out["sleeper_alive_after_kill"] is True
    # Verified while it served itself, then handed on: the kill path refuses the new process.
    assert out["verified_c"] is True
    assert "not the process whose agent memtop verified" in out["kill_handed_on"]["error"]  # type: ignore[index]
    assert out["sleeper_c_alive_after_kill"] is True


def test_without_peer_pidfds_the_start_times_refuse_it(
    scenarios: dict[str, subprocess.Popen[str]],
) -> None:
    out = scenario(scenarios["no-pidfd"])
    kill = out["kill_reused"]
    assert kill["error"] and not kill["message"], kill  # type: ignore[index]
    assert "failed authentication" in kill["error"]  # type: ignore[index,operator]
    assert out["sleeper_alive_after_kill"] is True
    assert out["verified_c"] is True
    assert "not the process whose agent memtop verified" in out["kill_handed_on"]["error"]  # type: ignore[index]
    assert out["sleeper_c_alive_after_kill"] is True
