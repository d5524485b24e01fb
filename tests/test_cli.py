"""The command line as scripts use it: real subprocesses, real simulated trainers."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop import protocol
from memtop.base import children

pytestmark = pytest.mark.slow


def memtop(
    *args: str, socket_dir: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if socket_dir is not None:
        env["MEMTOP_SOCKET_DIR"] = str(socket_dir)
    return subprocess.run(
        [sys.executable, "-m", "memtop.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_version_and_help():
    from memtop import __version__

    assert memtop("--version").stdout.strip() == f"memtop {__version__}"
    helped = memtop("--help")
    assert helped.returncode == 0 and "--once" in helped.stdout and "demo" in helped.stdout


@pytest.mark.parametrize(
    "args",
    [("--bogus",), ("--json",), ("demo", "--scenario", "nope"), ("--interval", "0"), ("run",)],
)
def test_usage_errors_exit_2(args):
    result = memtop(*args)
    assert result.returncode == 2
    assert result.stderr.strip()


@pytest.mark.parametrize("gpus", ["17", "1000", "0"])
def test_demo_refuses_more_gpus_than_a_box_holds_before_starting_any(socket_dir: Path, gpus: str):
    # `--gpus 1000` started ~1,003 trainers (load 50, no output for 20 s).
    try:
        result = memtop("demo", "--gpus", gpus, "--no-ui", socket_dir=socket_dir, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--gpus {gpus} started a demo")
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("memtop: --gpus")
    if gpus != "0":
        assert "at most 16 GPUs" in result.stderr
    assert list(socket_dir.iterdir()) == []  # no trainer started


def test_once_with_no_gpu_and_no_agents_says_so(socket_dir: Path):
    result = memtop("--once", socket_dir=socket_dir)
    assert result.returncode == 0
    assert "No GPUs and no memtop agents found" in result.stdout
    assert "memtop demo" in result.stdout and "memtop run" in result.stdout
    data = json.loads(memtop("--once", "--json", socket_dir=socket_dir).stdout)
    assert data["devices"] == [] and data["agents"] == []
    assert data["nvml"]["available"] is False and "NVML" in data["nvml"]["error"]


def test_actions_on_a_missing_pid_fail_with_one_line(socket_dir: Path):
    for args in (("cleanup", "999999"), ("snapshot", "999999", "-o", str(socket_dir / "x"))):
        result = memtop(*args, socket_dir=socket_dir)
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1 and "999999" in result.stderr


def _leak_demo(socket_dir: Path) -> Iterator[subprocess.Popen[str]]:
    # No snapshot cooldown (a test writes one, then one with --force at once), and a cleanup's
    # that a second cleanup meets however slow the box is.
    env = dict(
        os.environ,
        MEMTOP_SOCKET_DIR=str(socket_dir),
        MEMTOP_AGENT_TEST_LIMITS=(
            "snapshot_min_interval_s=0,on_demand_max_share=1,cleanup_min_interval_s=600"
        ),
    )
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memtop.cli",
            "demo",
            "--no-ui",
            "--scenario",
            "leak",
            "--step-time",
            "0.05",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert demo.stdout is not None
    banner = demo.stdout.readline()
    assert "simulated trainer" in banner, demo.stderr.read() if demo.stderr else ""
    # Actions run at the trainer's step boundaries: wait for its first step.
    from memtop.sources.agents import AgentClient

    (pid,) = protocol.list_agent_sockets(socket_dir)
    deadline = time.monotonic() + 30
    with AgentClient(pid, socket_dir, timeout=5) as client:
        client.connect()
        while not client.sample().step and time.monotonic() < deadline:
            time.sleep(0.05)
    yield demo
    children.stop(demo)  # TERM, then KILL past its deadline


@pytest.fixture
def leak_demo(socket_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A leak demo of the test's own, to stop."""
    yield from _leak_demo(socket_dir)


@pytest.fixture(scope="module")
def shared_leak_demo() -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """One leak demo for the tests that only ask it things (a demo and its trainer cost about
    2 CPU-s to start), in a socket directory of its own, and the directory.  Its tests come last
    in the module: the demo steps on until the module ends."""
    directory = Path(tempfile.mkdtemp(prefix="mt-"))
    directory.chmod(0o700)
    try:
        for demo in _leak_demo(directory):
            yield demo, directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_demo_sigterm_leaves_no_process_or_socket(leak_demo, socket_dir: Path):
    pids = protocol.list_agent_sockets(socket_dir)
    assert len(pids) == 1
    leak_demo.send_signal(signal.SIGTERM)
    assert leak_demo.wait(15) == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(protocol.pid_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(protocol.pid_alive(p) for p in pids)
    assert [p.name for p in socket_dir.iterdir()] == []


def test_demo_no_ui_then_once_json_twice_shows_steps_increasing(shared_leak_demo):
    _, socket_dir = shared_leak_demo
    time.sleep(1.0)
    first = json.loads(memtop("--once", "--json", socket_dir=socket_dir).stdout)
    time.sleep(1.0)
    second = json.loads(memtop("--once", "--json", socket_dir=socket_dir).stdout)
    for report in (first, second):
        assert report["version"] and report["time"] > 0
        assert len(report["agents"]) == 1
        assert report["devices"] and report["devices"][0]["source"] == "sim"
        device = report["devices"][0]
        for key in ("index", "uuid", "name", "total_bytes", "used_bytes", "source", "processes"):
            assert key in device
        agent = report["agents"][0]
        assert agent["devices"][0]["uuid"] == device["uuid"]  # joined by UUID
        dev = agent["devices"][0]
        for key in (
            "index",
            "uuid",
            "allocated_bytes",
            "reserved_bytes",
            "peak_bytes",
            "inactive_split_bytes",
            "fragmentation",
            "num_alloc_retries",
            "num_ooms",
            "step",
        ):
            assert key in dev, key
        assert dev["allocated_bytes"] > 0
        assert dev["reserved_bytes"] >= dev["allocated_bytes"]
        assert dev["peak_bytes"] >= dev["allocated_bytes"]
        # The simulated driver view counts the CUDA context on top of what torch reserved
        # (read a moment apart from the agent's sample, so compare with the context alone).
        process = next(p for p in device["processes"] if p["pid"] == agent["pid"])
        assert process["used_bytes"] >= 518 * 2**20
        assert dev["non_pytorch_bytes"] is not None
    assert second["agents"][0]["step"] > first["agents"][0]["step"] > 0


def test_cleanup_and_snapshot_commands(shared_leak_demo, tmp_path: Path):
    _, socket_dir = shared_leak_demo
    (pid,) = protocol.list_agent_sockets(socket_dir)
    out = tmp_path / "snap.pickle"
    result = memtop("snapshot", str(pid), "-o", str(out), socket_dir=socket_dir)
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    with open(out, "rb") as fh:
        data = pickle.load(fh)
    assert data["segments"] and all("blocks" in seg for seg in data["segments"])
    # The file is there now: a second snapshot refuses it unless told to overwrite.
    again = memtop("snapshot", str(pid), "-o", str(out), socket_dir=socket_dir)
    assert again.returncode != 0 and "--force" in again.stderr
    assert again.stderr.count("\n") == 1  # one line, no traceback
    forced = memtop("snapshot", str(pid), "-o", str(out), "--force", socket_dir=socket_dir)
    assert forced.returncode == 0, forced.stderr
    assert pickle.loads(out.read_bytes())["segments"]
    cleaned = memtop("cleanup", str(pid), "--json", socket_dir=socket_dir)
    assert cleaned.returncode == 0, cleaned.stderr
    payload = json.loads(cleaned.stdout)
    released = payload["released_bytes"]["0"]
    assert released == payload["reserved_before"]["0"] - payload["reserved_after"]["0"]
    assert released >= 0
    assert payload["at_step_boundary"] is True and payload["after_step"] >= 1
    # A second cleanup right away is refused by the agent's cooldown, in one line.
    soon = memtop("cleanup", str(pid), socket_dir=socket_dir)
    assert soon.returncode != 0 and "can run again in" in soon.stderr
    assert soon.stderr.count("\n") == 1
