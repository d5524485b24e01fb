"""A CPU-only trainer is served whole (issue 31, item 6): a host-memory leak verdict from its RSS
after each step, a detail chart of its host memory, and the keys that act on CUDA's caching
allocator refused with the reason.

A real torch trainer on the CPU under `memtop run` (examples/train_cpu.py --keep-logits: each
step's logits kept with their graph, so its activations stay alive and the RSS grows), watched
through the real sampler, the dashboard's view model, `--once --json` and the app under its pilot.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_helpers import live_app, notifications, wait_for

from memtop.diagnosis import Diagnoser
from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource
from memtop.ui import view

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cpu_trainer_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="mtcpu-"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


# One trainer for the module (a torch process costs ~2.5 CPU-s to start).  The keys test comes
# first, on the trainer as it starts (its row CPU-only; every key is refused before the agent
# is asked, so it changes nothing), then the leak test judges the same trainer from a store of
# its own.  (The other way round, a new dashboard on a trainer whose host leak was already
# found once showed nothing at all for `c` within 15 s, at load ~25; on a quiet box that order
# passed 3 runs of 3: not reproduced, noted in stop 44's closing note.)
@pytest.fixture(scope="module")
def leaking_cpu_trainer(cpu_trainer_dir: Path) -> Iterator[int]:
    pytest.importorskip("torch")
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(cpu_trainer_dir))
    env.pop("MEMTOP_AGENT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtop", "run", "examples/train_cpu.py", "--device", "cpu",
         "--step-time", "0.02", "--keep-logits", "--batch-size", "128", "--steps", "4000"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_cuda_keys_on_a_cpu_trainer_say_why_they_do_nothing(leaking_cpu_trainer, cpu_trainer_dir):
    from memtop.ui.widgets.process_table import ProcessTable

    pid, socket_dir = leaking_cpu_trainer, cpu_trainer_dir
    app, sampler = live_app(socket_dir)

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            table = app.query_one(ProcessTable)
            await wait_for(
                pilot,
                lambda: any(r.pid == pid and r.cpu_only for r in table.rows_by_key.values()),
                timeout=60,
            )
            key = next(k for k, r in table.rows_by_key.items() if r.pid == pid)
            table.move_cursor(row=table.get_row_index(key))
            for press, verb in (("c", "clean up"), ("s", "take a snapshot"), ("w", "record")):
                await pilot.press(press)
                await wait_for(
                    pilot,
                    lambda verb=verb: any(
                        "uses no CUDA device (CPU only)" in n and verb in n
                        for n in notifications(app)
                    ),
                )
            # Nothing was asked of the agent: no snapshot file, no confirmation screen.
            assert not any("Snapshot of pid" in n for n in notifications(app))
            assert app.screen is app.screen_stack[0]

    try:
        asyncio.run(main())
    finally:
        sampler.stop()


def test_a_cpu_trainer_that_keeps_its_logits_is_a_host_leak(leaking_cpu_trainer, cpu_trainer_dir):
    pid, socket_dir = leaking_cpu_trainer, cpu_trainer_dir
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    observer = Observer(store, Diagnoser(leak_refresh_s=0.0))
    try:
        deadline = time.monotonic() + 120
        while True:
            sampler.sample_once()
            observation = observer.latest()
            host = observation.diagnosis.hosts.get(pid)
            if (host is not None and host.leak.detected) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    finally:
        sampler.stop()
    assert host is not None, [a.pid for a in observation.agents]
    assert host.leak.detected, host.leak.reason
    assert host.leak.bytes_per_step is not None and host.leak.bytes_per_step > 0
    (suggestion,) = [s for s in observation.suggestions if s.rule == "host_leak"]
    assert suggestion.pid == pid and "per step" in suggestion.title
    assert "graph" in suggestion.detail

    # The table says it, and the detail screen charts the host memory (RSS, RSS after step).
    dashboard = view.build(observation)
    (row,) = [r for r in dashboard.processes if r.pid == pid]
    assert row.cpu_only and row.trend.startswith("host +"), row
    detail = view.build_detail(observation, row, None)
    names = {series.name: series for series in detail.series}
    assert {"RSS", "RSS after step"} <= set(names)
    assert len(names["RSS"].ys) >= 2 and names["RSS"].ys[-1] > names["RSS"].ys[0]

    # One connection judges it too (the first `sample` brings the buffered step marks).  Each
    # try is one connection; a loaded box (two suites at once) may have buffered too few marks
    # for the first, so a few tries, 3 s apart.
    for _ in range(4):
        out = subprocess.run(
            [sys.executable, "-m", "memtop", "--once", "--json", "--socket-dir", str(socket_dir)],
            capture_output=True, text=True, timeout=60,
            env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        (agent,) = [a for a in data["agents"] if a["pid"] == pid]
        if agent["host"]["leak"]["detected"]:
            break
        time.sleep(3)
    assert agent["host"]["leak"]["detected"] is True, agent["host"]["leak"]
    assert any(s["rule"] == "host_leak" and s["pid"] == pid for s in data["suggestions"])
