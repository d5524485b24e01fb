"""The dashboard's start (issue 35, the start-up budget of DESIGN §9): what it imports before the
first figures, and what the first round waits for before the GPUs are on screen."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.model import SOURCE_SIM, DeviceReading, DriverReading
from memtop.sources.agents import AgentPool
from memtop.ui import splash

HOSTILE = str(Path(__file__).with_name("hostile_agent.py"))
GIB = 2**30


def imported_by(code: str) -> set[str]:
    """The memtop modules a fresh interpreter has imported after running `code`."""
    result = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(result.stdout.split())


def test_the_dashboards_command_line_does_not_import_the_estimator() -> None:
    # `memtop estimate`'s arguments come from its tables (architectures, GPUs, dtypes): ~30 ms
    # of the dashboard's start went to importing them to build a parser it never used.
    modules = imported_by(
        "from memtop.commands.parser import build_parser\n"
        "args = build_parser().parse_args(['--interval', '2'])\n"
        "assert args.command is None and args.interval == 2.0"
    )
    assert not {m for m in modules if m.startswith("memtop.estimate")}
    # ... and `memtop estimate` still has them all.
    modules = imported_by(
        "from memtop.commands.parser import build_parser\n"
        "args = build_parser().parse_args(['estimate', '--preset', 'llama-7b', '--gpus', '2'])\n"
        "assert args.preset == 'llama-7b' and args.gpus == 2, args"
    )
    assert "memtop.estimate.command" in modules


class TwoGpus:
    """The driver's reading of two simulated GPUs, at once."""

    def read(self) -> DriverReading:
        return DriverReading(
            available=True,
            devices=(
                DeviceReading(0, "GPU-a", "NVIDIA H100 80GB HBM3", 80 * GIB, 31 * GIB),
                DeviceReading(1, "GPU-b", "NVIDIA H100 80GB HBM3", 80 * GIB, None),
            ),
            source=SOURCE_SIM,
        )

    def close(self) -> None:
        pass


def test_the_gpus_are_told_before_a_silent_agent_is_given_up(socket_dir: Path) -> None:
    # The first round waits a whole request deadline for an agent that accepts and never
    # answers; the driver's reading is on screen long before (the dashboard paints the GPUs'
    # rows with it, splash.driver_lines).
    agent = subprocess.Popen(
        [sys.executable, HOSTILE, "silent", str(socket_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
        sampler = Sampler(Store(), TwoGpus(), AgentPool(socket_dir), interval=1.0)
        told: list[tuple[float, DriverReading]] = []
        sampler.on_reading = lambda reading: told.append((time.monotonic(), reading))
        try:
            started = time.monotonic()
            sampler.sample_once()
            ended = time.monotonic()
        finally:
            sampler.stop()
    finally:
        agent.kill()
        agent.wait()
    assert ended - started >= 0.8 * sampler.agents.timeout  # the agent was waited for
    assert len(told) == 1 and told[0][1].devices[0].used_bytes == 31 * GIB
    assert told[0][0] - started < 0.5 * (ended - started)


def test_the_early_gpu_rows_are_the_views_rows() -> None:
    reading = TwoGpus().read()
    store = Store()
    with store.round():
        store.update_driver(reading, time.time())
    full = splash.figure_lines(Observer(store).publish(), 120, 36)
    early = splash.driver_lines(reading, 120)
    assert early[1:] == [line for line in full if line.startswith("GPU ")]
    assert early[1].split()[-2:] == ["38.8", "%"] and early[2].endswith("—")


def test_no_early_rows_where_the_view_would_differ() -> None:
    from dataclasses import replace

    from memtop.engine.scope import Scope
    from memtop.model import MigInfo

    reading = TwoGpus().read()
    only_one = splash.driver_lines(reading, 120, Scope(gpus=frozenset({1})))
    assert [line.split()[:2] for line in only_one[1:]] == [["GPU", "1"]]
    assert splash.driver_lines(DriverReading(available=False, error="no driver"), 120) == []
    remote = replace(reading, devices=(replace(reading.devices[0], host="node7"),))
    assert splash.driver_lines(remote, 120) == []
    mig = replace(reading.devices[0], mig=MigInfo(0, 1, 0, "3g.40gb"))
    assert splash.driver_lines(replace(reading, devices=(mig,)), 120) == []
    assert splash.driver_lines(reading, 120, Scope(instances=frozenset({(0, 1)}))) == []
