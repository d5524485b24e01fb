"""Opt-in emergency cleanup: at >= 95 % of the device, at a step boundary, rate-limited, logged,
and listed in the OOM report that follows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop.agent.auto_cleanup import AutoCleanup
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator, SimulatedOutOfMemoryError
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def setup(
    socket_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Agent, SimulatedCachingAllocator, list[str]]]:
    monkeypatch.setenv("MEMTOP_OOM_DIR", str(tmp_path / "oom"))
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(1 * GiB), 0)
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000002", "Sim GPU", 1 * GiB)
    agent = Agent(SimulatedProbe([SimulatedGpu(device, allocator)]), socket_dir)
    agent.start()
    lines: list[str] = []
    agent.boundary.on_boundary = AutoCleanup(agent, check_interval_s=0.0, log=lines.append)
    yield agent, allocator, lines
    agent.stop()


def test_cleans_at_95_percent_once_then_waits(setup):
    agent, allocator, lines = setup
    kept = allocator.malloc(100 * MiB)
    agent.on_step(explicit=True)
    assert lines == []  # 10 % used: nothing to do
    cached = [allocator.malloc(200 * MiB) for _ in range(4)]
    for block in cached:
        allocator.free(block)  # 800 MiB cached by "PyTorch", 900 of 1024 MiB reserved
    agent.on_step(explicit=True)
    cleanup = agent.boundary.on_boundary
    assert isinstance(cleanup, AutoCleanup)
    assert len(cleanup.runs) == 0, "88 % is under the threshold"
    busy = [allocator.malloc(200 * MiB) for _ in range(4)] + [allocator.malloc(80 * MiB)]
    for block in busy:
        allocator.free(block)  # 980 of 1024 MiB reserved: 95.7 %
    agent.on_step(explicit=True)
    assert len(cleanup.runs) == 1
    run = cleanup.runs[0]
    assert run["step"] == 3 and run["device"] == 0 and run["device_used_share"] >= 0.95
    assert run["released_bytes"]["0"] == 880 * MiB
    assert allocator.memory_reserved() == 100 * MiB
    assert len(lines) == 1 and "released 880.0 MiB" in lines[0] and "GPU 0 at 9" in lines[0]
    # Full again at once: rate-limited, no second cleanup.
    for block in [allocator.malloc(200 * MiB) for _ in range(4)]:
        allocator.free(block)
    agent.on_step(explicit=True)
    assert len(cleanup.runs) == 1
    # The OOM report that follows lists it.
    with pytest.raises(SimulatedOutOfMemoryError):
        allocator.malloc(2 * GiB)
    assert agent.oom.flush(5.0)
    (report_path,) = (Path(os.environ["MEMTOP_OOM_DIR"])).glob("oom-*.json")
    report = json.loads(report_path.read_text())
    assert [c["step"] for c in report["auto_cleanups"]] == [3]
    allocator.free(kept)


def test_memtop_run_auto_cleanup_turns_it_on(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, json, memtop.agent
            agent = memtop.agent.current_agent()
            hook = agent.boundary.on_boundary if agent else None
            print(json.dumps({"env": os.environ.get("MEMTOP_AUTO_CLEANUP"),
                              "hook": type(hook).__name__}))
            """
        )
    )
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(tmp_path / "s"))
    env.pop("MEMTOP_AUTO_CLEANUP", None)
    on = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "run", "--auto-cleanup", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert on.returncode == 0, on.stderr
    assert json.loads(on.stdout.splitlines()[-1]) == {"env": "1", "hook": "AutoCleanup"}
    off = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "run", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout.splitlines()[-1]) == {"env": None, "hook": "NoneType"}
