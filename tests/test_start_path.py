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


def test_the_live_dashboard_leaves_out_the_estimator_and_asyncios_tls() -> None:
    # What the dashboard's start imports (memtop.commands.watch): the diagnosis took the
    # estimator's tables with calibrate.BatchModel (~1 MB), and Textual's asyncio took OpenSSL
    # (~4 MB of RSS) for TLS transports its event loop never opens.
    modules = imported_by(
        "from memtop.ui.start import import_asyncio_without_tls\n"
        "assert import_asyncio_without_tls()\n"
        "import memtop.commands.watch, memtop.engine.sampler, memtop.sources.devices\n"
        "import memtop.engine.observation, memtop.ui.app, memtop.ui.splash\n"
        "import asyncio\n"
        "loop = asyncio.new_event_loop(); loop.run_until_complete(asyncio.sleep(0)); loop.close()"
    )
    assert "ssl" not in modules and "_ssl" not in modules
    assert "memtop.estimate.architecture" not in modules
    assert "memtop.estimate.calibrate" in modules  # the one part the diagnosis uses
    # ssl itself is still there for whoever asks (urllib's https, the exporter's TLS).
    modules = imported_by(
        "from memtop.ui.start import import_asyncio_without_tls\n"
        "assert import_asyncio_without_tls()\n"
        "import ssl; ssl.create_default_context()"
    )
    assert "ssl" in modules


def test_the_dashboards_start_asks_for_one_malloc_arena() -> None:
    # glibc's default, up to 8 arenas per core, left a part-empty arena behind each thread
    # (the sampler, the device reader, the agents' workers, Textual's input): ~3 MB.
    import platform

    from memtop.ui import start

    if platform.libc_ver()[0] != "glibc":
        assert not start.one_malloc_arena()
        return
    assert start.one_malloc_arena()
    source = Path(start.__file__).with_name("..").resolve() / "commands" / "watch.py"
    text = source.read_text()
    # ... before the sampler (and its threads) exist.
    assert text.index("one_malloc_arena()") < text.index("common.make_sampler(args, simulated")
