"""The dashboard's start (issue 35, the start-up budget of DESIGN §9): what it imports before the
first figures, and what the first round waits for before the GPUs are on screen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def imported_after(*steps: str) -> list[set[str]]:
    """The memtop modules one fresh interpreter has imported after each of `steps`, run in
    turn: a start and then what it adds (a screen opened, another command's parser) in one
    interpreter, not a second one that imports the start again (~0.1-0.4 CPU-s each)."""
    code = "import sys\n" + "".join(
        f"{step}\nprint('modules', ' '.join(sorted(sys.modules)))\n" for step in steps
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    found = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("modules ")]
    assert len(found) == len(steps), result.stdout
    return [set(modules) for modules in found]


def test_the_dashboards_command_line_does_not_import_the_estimator() -> None:
    # `memtop estimate`'s arguments come from its tables (architectures, GPUs, dtypes): ~30 ms
    # of the dashboard's start went to importing them to build a parser it never used.
    dashboard, estimate = imported_after(
        "from memtop.commands.parser import build_parser\n"
        "args = build_parser().parse_args(['--interval', '2'])\n"
        "assert args.command is None and args.interval == 2.0",
        # ... and `memtop estimate` still has them all.
        "args = build_parser().parse_args(['estimate', '--preset', 'llama-7b', '--gpus', '2'])\n"
        "assert args.preset == 'llama-7b' and args.gpus == 2, args",
    )
    assert not {m for m in dashboard if m.startswith("memtop.estimate")}
    assert "memtop.estimate.command" in estimate


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


def test_the_dashboards_record_classes_say_what_they_are() -> None:
    # A dataclass without a docstring gets one from Python as it is made: its name and
    # inspect.signature of its __init__ (~0.1 ms a class, 28 of the 85 the dashboard imports
    # before its first frame: ~2-5 ms of the start).  Each says what it is instead.
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import dataclasses, inspect, sys\n"
            "import memtop.commands.watch, memtop.engine.sampler, memtop.sources.devices\n"
            "import memtop.sources.agents, memtop.engine.observation, memtop.ui.app\n"
            "import memtop.sim.devices_view, memtop.sim.demo\n"
            "for name, module in sorted(sys.modules.items()):\n"
            "    if not name.startswith('memtop'):\n"
            "        continue\n"
            "    for cls in vars(module).values():\n"
            "        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):\n"
            "            continue\n"
            "        if cls.__module__ != name:\n"
            "            continue\n"
            "        made = cls.__name__ + str(inspect.signature(cls)).replace(' -> None', '')\n"
            "        print(cls.__qualname__, cls.__doc__ == made)\n",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    made_by_python = [
        line.split()[0] for line in result.stdout.splitlines() if line.endswith("True")
    ]
    assert len(result.stdout.splitlines()) > 80  # the records the dashboard's start imports
    assert made_by_python == []


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


# Logs, from inside `python -m memtop`, what the three collector tests below read from one
# dashboard's start (not one start each: ~0.5 CPU-s and 3 s of wall a start): each collection the
# cyclic collector starts, with its generation, the objects it walks (those of its generation
# and the younger ones) and when; when the collector is turned off and back on; and the frozen
# objects and gen-0 budget each time they change.  A thread looks every 5 ms; the times are
# time.monotonic (one clock for the whole machine).
GC_LOG = """
import gc, runpy, sys, threading, time
log = open(sys.argv[1], "w", buffering=1)
def collecting(phase, info):
    if phase == "start":
        at = time.monotonic()
        young = range(info["generation"] + 1)
        walked = sum(len(gc.get_objects(g)) for g in young)
        log.write(f"collect {info['generation']} {walked} {at}\\n")
gc.callbacks.append(collecting)
def watch():
    on, settled = True, None
    while True:
        if gc.isenabled() != on:
            on = not on
            log.write(f"{'on' if on else 'off'} {time.monotonic()}\\n")
        now = (gc.get_freeze_count(), gc.get_threshold()[0])
        if now != settled:
            settled = now
            log.write(f"gc {now[0]} {now[1]}\\n")
        time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
sys.argv[1:] = []
runpy.run_module("memtop", run_name="__main__", alter_sys=True)
"""


def _dashboard_with(
    watch: str,
    tmp_path: Path,
    linger: float = 0.0,
    until: str | tuple[str, ...] | None = "on ",
    **env_extra: str,
) -> tuple[Path, float, float]:
    """Runs the dashboard in a terminal under `watch` (a script given its log file), until its
    first frame, ten seconds more at most for `until` to be in the log (by default: the
    collector back on; several: all of them; None: no wait), and `linger` s more; the log,
    when the header was seen and when the frame was.  `env_extra`: more of the dashboard's
    environment."""
    import os

    from memtop.base import children

    log = tmp_path / "gc.log"
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(tmp_path), TERM="xterm-256color", **env_extra)
    # The terminal's size is the pty's: COLUMNS and LINES, where the test's own environment has
    # them, come before it for Textual's driver and Rich (shutil.get_terminal_size), and an 80x24
    # pair drew the first frame laid out for 80x24 on this 120x36 terminal (bench/tui_cost.py's
    # children drop them too).
    for name in ("COLUMNS", "LINES"):
        env.pop(name, None)
    command = [sys.executable, "-c", watch, str(log)]
    process, master = children.start_in_terminal(command, (120, 36), env)
    try:
        seen, header_at, frame_at = b"", None, None
        deadline = time.monotonic() + 60
        while frame_at is None and time.monotonic() < deadline:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
            if header_at is None and b"starting" in seen:
                header_at = time.monotonic()
            # Textual's first frame: the process pane, or the empty state where no GPU is.
            if b"Processes" in seen or b"memtop demo" in seen:
                frame_at = time.monotonic()
        assert header_at is not None and frame_at is not None, seen[-400:]
        wanted = (until,) if isinstance(until, str) else until or ()
        while wanted and time.monotonic() < frame_at + 10:
            text = log.read_text()
            if all(w in text for w in wanted):
                break
            time.sleep(0.05)
        time.sleep(linger)
        os.write(master, b"q")
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    return log, header_at, frame_at


@pytest.fixture(scope="module")
def gc_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[str]], float, float]:
    """One dashboard's start under GC_LOG, until the collector is back on and settled and a
    second more (the collections after it): the log's lines split in fields, when the header
    was seen and when the first frame was."""
    from memtop.ui.app import GC_GEN0_THRESHOLD

    log, header_at, frame_at = _dashboard_with(
        GC_LOG,
        tmp_path_factory.mktemp("gc"),
        until=("on ", f" {GC_GEN0_THRESHOLD}\n"),
        linger=1.0,
    )
    return [line.split() for line in log.read_text().splitlines() if line], header_at, frame_at


def test_the_collector_is_held_until_the_dashboards_first_frame(
    gc_log: tuple[list[list[str]], float, float],
) -> None:
    # ~100 collections ran while Textual and memtop were imported, 15-25 % of the CPU before the
    # first frame, for under a thousand objects freed (memtop.base.start_gc).
    lines, header_at, frame_at = gc_log
    events = [(f[0], float(f[-1])) for f in lines if f[0] in ("on", "off", "collect")]
    names = [name for name, _ in events]
    # Off from the start (before memtop's header was painted), on again once the frame is out.
    assert "off" in names and "on" in names, names
    off_at = next(at for name, at in events if name == "off")
    on_at = next(at for name, at in events if name == "on")
    assert off_at < header_at < on_at < frame_at + 10
    # Before Textual's frame reached us (a collection or two may land between the collector's
    # return and our read): ~100 while it was on through the start.
    during_start = [at for name, at in events if name == "collect" and off_at < at < frame_at]
    assert len(during_start) < 10, events


def test_the_starts_objects_are_not_walked_when_the_collector_is_back(
    gc_log: tuple[list[list[str]], float, float],
) -> None:
    # Held through the start, the collector left every object of it in its youngest generation:
    # the first collections once it was back walked them all (~200 000 objects, three times:
    # young, middle, old), tens of milliseconds in the dashboard's first second.  They are
    # frozen when it comes back (memtop.base.start_gc.release).
    lines, _, _ = gc_log
    names = [f[0] for f in lines]
    assert "on" in names, lines
    after = [f for f in lines[names.index("on") :] if f[0] == "collect"]
    walked = [int(objects) for _, _, objects, _ in after]
    assert walked and max(walked) < 20_000, after


def test_the_dashboard_settles_the_collector_after_its_first_frame(
    gc_log: tuple[list[list[str]], float, float],
) -> None:
    # Once the first frame with data is out, what the start made is frozen out of every
    # collection and gen 0 gets a budget fit for a long-lived UI (memtop.ui.app._settle_gc).
    # It was done only where the first round landed after the app mounted; the dashboard's
    # start paints that round before Textual is even imported (memtop.commands.watch), so a
    # real dashboard never settled it: a full collection of Textual's start-up objects every
    # few seconds, ~10 % of its CPU under the mixed demo.
    from memtop.ui.app import GC_GEN0_THRESHOLD

    states = [(int(f[1]), int(f[2])) for f in gc_log[0] if f[0] == "gc"]
    assert any(frozen > 0 and budget == GC_GEN0_THRESHOLD for frozen, budget in states), states


def test_commands_other_than_the_dashboard_run_with_the_collector(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gc

    from memtop import cli

    seen: list[bool] = []

    def run(args: object) -> int:
        seen.append(gc.isenabled())
        return 0

    monkeypatch.setattr(cli, "runner", lambda command: run)
    assert gc.isenabled()
    assert cli.main(["oom"]) == 0
    assert seen == [True] and gc.isenabled()


def test_what_only_an_opened_screen_shows_is_imported_when_it_opens() -> None:
    # The GPU's chart (memtop.ui.stacked, 4 records: ~3 ms of the start), the help, detail,
    # GPU and dialog screens: none is on the first frame.
    start = (
        "from memtop.ui.start import import_asyncio_without_tls\n"
        "import_asyncio_without_tls()\n"
        "import memtop.commands.watch, memtop.engine.sampler, memtop.sources.devices\n"
        "import memtop.engine.observation, memtop.ui.app, memtop.ui.splash, memtop.ui.view\n"
    )
    modules, with_gpu_screen = imported_after(start, "import memtop.ui.screens.gpu")
    opened_later = {m for m in modules if m.startswith(("memtop.ui.screens", "memtop.ui.stacked"))}
    assert not opened_later and "memtop.ui.widgets.gpu_chart" not in modules, opened_later
    # ... and a GPU's screen still has its chart.
    assert "memtop.ui.stacked" in with_gpu_screen


def test_the_gpus_are_read_before_the_diagnosis_is_imported() -> None:
    # The dashboard's start paints the GPUs' rows from the sampler's first driver reading; the
    # sampler's feed and the scope (--only, --user, --pid) imported the observer, and with it
    # the whole diagnosis (leak, workload, fragmentation, suggestions: ~40 ms of CPU), before
    # that reading could be taken.  The observer is imported after the rows are on screen
    # (memtop.commands.watch).
    modules, with_observer = imported_after(
        "from memtop.commands import common\n"
        "from memtop.commands.parser import build_parser\n"
        "args = build_parser().parse_args(['--only', '0', '--user', 'root'])\n"
        "sampler = common.make_sampler(args)\n"
        "scope = common.scope(args)\n"
        "sampler.stop()",
        # ... and a feed still makes its observer (the dashboard's and the replay's).
        "from memtop.engine.feed import FeedLoop\n"
        "from memtop.engine.store import Store\n"
        "assert FeedLoop(Store()).observer(host='h', uid=0).host == 'h'",
    )
    assert "memtop.engine.sampler" in modules
    early = {m for m in modules if m.startswith(("memtop.diagnosis", "memtop.engine.observation"))}
    assert not early, early
    assert "memtop.engine.observation" in with_observer


def test_the_toml_parser_is_imported_only_for_a_config_file(tmp_path: Path) -> None:
    # Most starts have no ~/.config/memtop/config.toml: tomllib (~0.7 MB) waited for nothing.
    missing, present = tmp_path / "none.toml", tmp_path / "config.toml"
    present.write_text('theme = "monochrome"\n')
    load = "from pathlib import Path\nfrom memtop.ui import config\nc = config.load(Path({!r}))\n"
    defaults = "assert c.theme == 'memtop' and not c.problems"
    modules = imported_by(load.format(str(missing)) + defaults)
    assert "memtop.ui.config" in modules and "tomllib" not in modules
    modules = imported_by(load.format(str(present)) + "assert c.theme == 'monochrome', c")
    assert "tomllib" in modules
    # ... and a file that is not TOML is still one line, not a traceback.
    present.write_text("theme = \n")
    modules = imported_by(
        load.format(str(present)) + "assert 'is not valid TOML' in c.problems[0], c.problems"
    )
    assert "tomllib" in modules


ENTRY_POINT_GC = """
import gc
import memtop  # the package's own start (the trainer's import too) is not the command's
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
from {module} import {function} as entry
import memtop.cli
assert entry is memtop.cli.main
print(len(collections), gc.isenabled())
try:
    entry(["--version"])
except SystemExit:
    pass
print(gc.isenabled())
"""


def test_the_memtop_command_holds_the_collector_before_its_imports() -> None:
    # The console script pip writes does `from MODULE import FUNCTION`, then calls it: with
    # memtop.cli as MODULE, its imports (the records, the protocol, the parser) ran with the
    # collector on, ~17 collections before main() could hold it (memtop.base.start_gc).
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    entry = tomllib.loads(pyproject.read_text())["project"]["scripts"]["memtop"]
    module, function = entry.split(":")
    result = subprocess.run(
        [sys.executable, "-c", ENTRY_POINT_GC.format(module=module, function=function)],
        capture_output=True,
        text=True,
        check=True,
    )
    # None while memtop.cli was imported (one may land while start_gc itself is imported), the
    # collector still held; main() gives it back.
    lines = result.stdout.splitlines()  # (--version prints its line between)
    count, enabled = lines[0].split()
    assert int(count) <= 2 and enabled == "False" and lines[-1] == "True", result


NVML_READ = """
import sys
from memtop.sources.nvml import NvmlSource
reading = NvmlSource().read()
assert not reading.available
print(reading.error)
print("pynvml" in sys.modules)
"""


def _read_nvml(env: dict[str, str]) -> tuple[str, bool]:
    """What a fresh interpreter's NvmlSource says, and whether it imported pynvml."""
    result = subprocess.run(
        [sys.executable, "-c", NVML_READ], capture_output=True, text=True, check=True, env=env
    )
    error, imported = result.stdout.splitlines()
    return error, imported == "True"


def test_no_nvml_bindings_are_imported_where_no_nvml_can_be(tmp_path: Path) -> None:
    # pynvml (~20 ms of the first reading, before the GPUs' rows; ~3 MB) was imported on a box
    # without NVIDIA only for nvmlInit to say that its library is missing.
    import ctypes.util
    import os

    from memtop.sources.driver_libraries import DEV_DIR_ENV

    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("this box has an NVML library")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env[DEV_DIR_ENV] = str(tmp_path)  # no /dev/nvidia* in it
    error, imported = _read_nvml(env)
    assert not imported
    # ... with the very line the bindings give there: with a GPU's node present they are
    # imported, and their nvmlInit finds no library (as root they are not: root lets nothing
    # look for the library by name where its own check found no file).
    (tmp_path / "nvidia0").touch()
    assert _read_nvml(env) == (error, os.geteuid() != 0)
    assert (
        error
        == "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"
    )


def test_an_nvml_library_anywhere_the_linker_looks_is_looked_for(tmp_path: Path) -> None:
    from memtop.sources.driver_libraries import DEV_DIR_ENV, NVML_NAME, nvml_absent

    dev, libs = tmp_path / "dev", tmp_path / "libs"
    dev.mkdir()
    hwcaps = libs / "glibc-hwcaps" / "x86-64-v3"
    hwcaps.mkdir(parents=True)
    env = {DEV_DIR_ENV: str(dev), "LD_LIBRARY_PATH": f"/nonexistent:{libs}"}
    if not nvml_absent({DEV_DIR_ENV: str(dev)}):
        pytest.skip("this box has an NVML library")
    assert nvml_absent(env)
    (hwcaps / NVML_NAME).touch()  # only a name: nothing is loaded
    assert not nvml_absent(env)
    (hwcaps / NVML_NAME).unlink()
    (libs / NVML_NAME).symlink_to("/nonexistent/libnvidia-ml.so.1")
    assert nvml_absent(env)  # a dangling link loads nothing
    (libs / NVML_NAME).unlink()
    (libs / NVML_NAME).touch()
    assert not nvml_absent(env)


# Runs `python -m memtop` with the agents' first answer a second late, logging when the first
# round's observation is made and when Textual composes the app.
SLOW_FIRST_ROUND = """
import runpy, sys, time
from memtop.engine.observation import Observer
from memtop.sources.agents import AgentPool
from memtop.ui import app
log = open(sys.argv[1], "w", buffering=1)
poll = AgentPool.poll
def slow_first_poll(self, *args, **kwargs):
    if not getattr(AgentPool, "polled", False):
        AgentPool.polled = True
        time.sleep(1.0)
    return poll(self, *args, **kwargs)
AgentPool.poll = slow_first_poll
publish = Observer.publish
def logged_publish(self, *args, **kwargs):
    observation = publish(self, *args, **kwargs)
    log.write(f"published {time.monotonic()}\\n")
    return observation
Observer.publish = logged_publish
compose = app.MemtopApp.compose
def logged_compose(self):
    log.write(f"compose {time.monotonic()}\\n")
    return compose(self)
app.MemtopApp.compose = logged_compose
sys.argv[1:] = []
runpy.run_module("memtop", run_name="__main__", alter_sys=True)
"""


def test_textual_starts_while_the_first_round_is_awaited(tmp_path: Path) -> None:
    # The dashboard's first frame draws the first round when it lands within the start's wait
    # (MEMTOP_FIRST_ROUND_WAIT_S here).  The wait was before Textual's start, so in a start whose
    # agents answered late (11 agents' first samples, ~1000 buffered step marks each) Textual's
    # own start (driver, CSS, mount: ~0.1 s) came after it; it runs meanwhile now, and only the
    # first frame waits for the round.
    log, _, frame_at = _dashboard_with(
        SLOW_FIRST_ROUND, tmp_path, until=None, MEMTOP_FIRST_ROUND_WAIT_S="10"
    )
    events = dict(line.split() for line in log.read_text().splitlines() if line)
    published, composed = float(events["published"]), float(events["compose"])
    assert composed < published, events  # Textual started while the agents answered
    assert frame_at > published, (frame_at, events)  # and its first frame drew their round


# Logs, from inside `python -m memtop`, each Resize the app handles: its size, whether the app
# was mounted, and how many times it built the view for it.
RESIZE_WATCH = """
import runpy, sys
from memtop.ui import app
log = open(sys.argv[1], "w", buffering=1)
on_resize = app.MemtopApp.on_resize
def logged(self, event):
    before = self.refreshes
    on_resize(self, event) if on_resize.__code__.co_argcount > 1 else on_resize(self)
    size = f"{event.size.width}x{event.size.height}"
    log.write(f"resize {size} mounted={self._mounted} built={self.refreshes - before}\\n")
app.MemtopApp.on_resize = logged
sys.argv[1:] = []
runpy.run_module("memtop", run_name="__main__", alter_sys=True)
"""


def test_the_drivers_resize_of_the_same_size_does_not_build_the_first_frame_again(
    tmp_path: Path,
) -> None:
    # Textual gives the app a Resize before its mount, and the terminal's driver another one of
    # the same size just after it, before the first frame: that one rebuilt every widget's
    # figures (the whole view, ~2 ms) for the frame they had just been built for.
    log, _, _ = _dashboard_with(RESIZE_WATCH, tmp_path, until=None, linger=0.5)
    resizes = [line.split() for line in log.read_text().splitlines()]
    after_mount = [r for r in resizes if r[2] == "mounted=True"]
    assert after_mount, resizes  # the driver's own Resize came
    assert all(size == "120x36" and built == "built=0" for _, size, _, built in after_mount), (
        resizes
    )


def test_a_new_terminal_size_still_builds_the_view_anew() -> None:
    import asyncio

    from textual import events
    from textual.geometry import Size
    from ui_frozen import MY_UID, NOW, frozen_store

    from memtop.ui.app import MemtopApp

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)

    async def run() -> tuple[int, int, int]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            mounted = app.refreshes
            app.post_message(events.Resize(Size(120, 36), Size(120, 36)))
            await pilot.pause()
            same = app.refreshes
            await pilot.resize_terminal(100, 30)
            await pilot.pause()
            return mounted, same, app.refreshes

    mounted, same, resized = asyncio.run(run())
    assert (same, resized) == (mounted, mounted + 1)


# `python -m memtop --interval 5` over two simulated GPUs almost full (the driver's reading alone:
# two suggestions about them, one about the missing agents), logging every 20 ms the pane's
# first suggestion as worded, from the first frame on.
SUGGESTIONS_WATCH = """
import runpy, sys, threading, time
from memtop.model import SOURCE_SIM, DeviceReading, DriverReading
from memtop.sources.devices import DefaultDeviceSource
from memtop.ui import app
log = open(sys.argv[1], "w", buffering=1)
GIB = 2**30
READING = DriverReading(
    available=True,
    devices=(
        DeviceReading(0, "GPU-a", "NVIDIA H100 80GB HBM3", 80 * GIB, 76 * GIB),
        DeviceReading(1, "GPU-b", "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB),
    ),
    source=SOURCE_SIM,
)
DefaultDeviceSource.read = lambda self, *args, **kwargs: READING
apps = []
init = app.MemtopApp.__init__
def kept(self, *args, **kwargs):
    init(self, *args, **kwargs)
    apps.append(self)
app.MemtopApp.__init__ = kept
def watch():
    seen = None
    while True:
        time.sleep(0.02)
        pane = apps[0].suggestions if apps and apps[0]._mounted else None
        if pane is not None and pane.option_count:
            first = pane.get_option_at_index(0).prompt
            text = getattr(first, "plain", str(first)).split("\\n")[0]
            if text != seen:
                seen = text
                log.write(f"{time.monotonic()} {text!r}\\n")
threading.Thread(target=watch, daemon=True).start()
sys.argv[1:] = ["--interval", "5"]
runpy.run_module("memtop", run_name="__main__", alter_sys=True)
"""


def test_the_first_screens_suggestions_are_worded_once_the_pane_has_its_width(
    tmp_path: Path,
) -> None:
    # The view's first build runs in on_mount, before Textual has laid anything out: the
    # suggestions were worded for a pane of no width, each line one "…", and stayed so until the
    # next round (a second by default) made the pane word them again at its width.  They are
    # worded again at the pane's width in the frame that first draws it
    # (SuggestionsPane._word_at_width; test_textuals_first_frame_is_the_whole_dashboard_...).
    log, _, frame_at = _dashboard_with(SUGGESTIONS_WATCH, tmp_path, until=None, linger=1.5)
    worded = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert worded, "no suggestion on screen"
    at, last = float(worded[-1][0]), worded[-1][1]
    assert "memory at" in last, worded
    assert at < frame_at + 1.0, worded  # long before the next round, 5 s on


# `python -m memtop --interval 5` over two simulated GPUs almost full, one of them running a real
# process (a child that sleeps): logs every frame Textual writes to the terminal (what its
# driver is given in one App._display, as JSON), and each time, after the first frame, that the
# process table asks for a new layout or the suggestions pane is given new options.
FRAMES_WATCH = """
import json, runpy, subprocess, sys, time
from memtop.model import SOURCE_SIM, DeviceReading, DriverReading, GpuProcess
from memtop.sources.devices import DefaultDeviceSource
from memtop.ui import app
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane
log = open(sys.argv[1], "w", buffering=1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
GIB = 2**30
READING = DriverReading(
    available=True,
    devices=(
        DeviceReading(0, "GPU-a", "NVIDIA H100 80GB HBM3", 80 * GIB, 76 * GIB,
                      processes=(GpuProcess(child.pid, 70 * GIB),)),
        DeviceReading(1, "GPU-b", "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB),
    ),
    source=SOURCE_SIM,
)
DefaultDeviceSource.read = lambda self, *args, **kwargs: READING
frames = 0
display = app.MemtopApp._display
def logged_display(self, screen, renderable):
    global frames
    driver = self._driver
    if driver is None or renderable is None:
        return display(self, screen, renderable)
    written = []
    write = driver.write
    driver.write = lambda data: (written.append(data), write(data))[1]
    try:
        display(self, screen, renderable)
    finally:
        driver.write = write
    if written:
        frames += 1
        log.write(json.dumps(["frame", "".join(written)]) + "\\n")
app.MemtopApp._display = logged_display
refresh = ProcessTable.refresh
def logged_refresh(self, *regions, layout=False, **kwargs):
    if layout and frames:
        log.write(json.dumps(["table layout", ""]) + "\\n")
    return refresh(self, *regions, layout=layout, **kwargs)
ProcessTable.refresh = logged_refresh
set_options = SuggestionsPane.set_options
def logged_set_options(self, options):
    if frames:
        log.write(json.dumps(["suggestions set", ""]) + "\\n")
    return set_options(self, options)
SuggestionsPane.set_options = logged_set_options
sys.argv[1:] = ["--interval", "5"]
try:
    runpy.run_module("memtop", run_name="__main__", alter_sys=True)
finally:
    child.kill()
"""

_SEQUENCE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b[()][0-9A-B]|\x1b[=>78]")


def _painted(frame: str, size: tuple[int, int]) -> list[str]:
    """The screen a frame paints on a blank terminal of `size` (columns, rows): its cursor moves
    and characters, styles left out (each character one cell, as memtop's are)."""
    columns, rows = size
    screen = [[" "] * columns for _ in range(rows)]
    y = x = 0

    def put(text: str) -> None:
        nonlocal x, y
        for char in text:
            if char == "\n":  # a line feed (Textual ends each line of a frame with one)
                y += 1
                continue
            if char == "\r":
                x = 0
                continue
            if 0 <= y < rows and 0 <= x < columns:
                screen[y][x] = char
            x += 1

    at = 0
    for sequence in _SEQUENCE.finditer(frame):
        put(frame[at : sequence.start()])
        at = sequence.end()
        if sequence.group(2) == "H":  # cursor position, 1-based "row;column"
            row, _, column = (sequence.group(1) or "1;1").partition(";")
            y, x = int(row or 1) - 1, int(column or 1) - 1
    put(frame[at:])
    return ["".join(line) for line in screen]


@pytest.fixture(scope="module")
def frames_and_events(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    """What one dashboard under FRAMES_WATCH painted and did, in order: one run for the two
    tests below (its first frame, and what came after it), not one each (~0.5 CPU-s, 3 s)."""
    log, _, _ = _dashboard_with(
        FRAMES_WATCH, tmp_path_factory.mktemp("frames"), until=None, linger=1.5
    )
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


def test_textuals_first_frame_is_the_whole_dashboard_laid_out_for_its_width(
    frames_and_events: list[tuple[str, str]],
) -> None:
    # The view's first build runs in on_mount, before Textual lays anything out: the table's
    # rows were laid out for a table of no width (no USER, CPU%, RSS or TIME column, the command
    # cut to "python …") and each suggestion worded for a pane of none (a column of "…").
    # Textual's first frame showed them so; the table laid itself out again on its own Resize
    # and the suggestions were worded again once the frame was out (on_ready), ~40-75 ms later.
    # Each is now laid out for the width it is drawn at, in the frame that first draws it.
    events = frames_and_events
    frames = [text for kind, text in events if kind == "frame"]
    assert frames, events
    screen = _painted(frames[0], (120, 36))
    shown = "\n".join(screen)
    header = next((line for line in screen if " PID " in line), "")
    wrong = [
        f"no {label} column"
        for label in ("USER", "GPU", "USED", "CPU%", "RSS", "TIME", "STEP", "COMMAND")
        if f" {label} " not in header
    ]
    # The child's row: its command as long as the table's room lets it be.
    if "python -c import time" not in shown:
        wrong.append("the command cut short")
    # The suggestions worded for the pane: each title whole, no line of it a lone "…".
    if "GPU 0 memory at 95.0 %" not in shown or "GPU 1 memory at 98.8 %" not in shown:
        wrong.append("no suggestion worded")
    if [line for line in screen if line.strip("│ ") == "…"]:
        wrong.append("suggestion lines of one '…'")
    assert not wrong, f"{wrong}\n{shown}"


def test_nothing_is_laid_out_again_after_the_first_frame_for_its_width(
    frames_and_events: list[tuple[str, str]],
) -> None:
    # Without a round after it (--interval 5), the first frame stands: the table asks for no
    # new layout (its own Resize laid its rows out again and asked for one, and a frame), and
    # the suggestions are not set anew (on_ready worded them again, and repainted the pane).
    events = frames_and_events
    after_first = [kind for kind, _ in events if kind != "frame"]
    assert after_first == [], [kind for kind, _ in events]


# Logs, from inside `python -m memtop`, the memtop modules imported once the collector is back on
# (after the dashboard's first frame: memtop.base.start_gc).
MODULES_WATCH = """
import gc, runpy, sys, threading, time
log = open(sys.argv[1], "w", buffering=1)
def watch():
    while gc.isenabled():
        time.sleep(0.005)
    while not gc.isenabled():
        time.sleep(0.005)
    names = sorted(m for m in list(sys.modules) if "memtop" in m or m == "pynvml")
    log.write("modules " + " ".join(names) + "\\n")
threading.Thread(target=watch, daemon=True).start()
sys.argv[1:] = []
runpy.run_module("memtop", run_name="__main__", alter_sys=True)
"""

# What the dashboard's start on a GPU box has no use for: the simulator (the demo's stand-in for
# a driver) and the subcommands' modules (argparse needs only their names and help): 7 modules,
# ~2.4 ms of their own import time on a GPU box.  (The agent stays: `memtop/__init__` imports it
# plainly, for the trainer's `memtop.start_agent()`.)
NOT_FOR_THE_DASHBOARD = {
    "memtop.sim.device",
    "memtop.sim.demo",
    "memtop.commands.attach",
    "memtop.commands.compare",
    "memtop.commands.record",
    "memtop.commands.replay",
    "memtop.commands.report",
}


def _standin_driver(tmp_path: Path) -> dict[str, str]:
    """The environment of a memtop whose NVML (the real nvidia-ml-py over the tests' stand-in
    driver) answers with one GPU."""
    import os

    from nvml_standin import Gpu, State, build, env

    state = State(gpus=[Gpu()], processes=[(0, os.getpid(), GIB)]).write(tmp_path / "state")
    return env(build(tmp_path / "lib"), state)


def test_a_gpu_boxs_dashboard_starts_without_the_simulator_the_agent_or_other_commands(
    tmp_path: Path,
) -> None:
    import os

    standin = _standin_driver(tmp_path)
    log, _, _ = _dashboard_with(
        MODULES_WATCH,
        tmp_path,
        until="modules ",
        **{k: v for k, v in standin.items() if os.environ.get(k) != v},
    )
    modules = set(log.read_text().split("modules ", 1)[1].split())
    assert "pynvml" in modules and "memtop.ui.app" in modules, modules  # its driver answered
    assert not modules & NOT_FOR_THE_DASHBOARD, modules & NOT_FOR_THE_DASHBOARD


def test_memtop_once_imports_only_what_it_prints(tmp_path: Path) -> None:
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    code = (
        "import runpy, sys\n"
        f"sys.argv[1:] = ['--socket-dir', {str(sockets)!r}, '--once', '--json']\n"
        "try:\n"
        "    runpy.run_module('memtop', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as done:\n"
        "    assert not done.code, done.code\n"
        "print('MODULES', ' '.join(sorted(m for m in sys.modules if 'memtop' in m)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_standin_driver(tmp_path),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    report, modules_line = done.stdout.rsplit("MODULES", 1)
    assert json.loads(report)["nvml"]["source"] == "nvml"
    modules = set(modules_line.split())
    assert not modules & NOT_FOR_THE_DASHBOARD, modules & NOT_FOR_THE_DASHBOARD


def test_the_subcommands_still_have_their_arguments_and_help() -> None:
    # Their modules are imported when they parse (or print their help), each its own.
    for argv, module, check in (
        (["record", "-o", "x.memtop", "--seconds", "3"], "record", "args.seconds == 3.0"),
        (["replay", "x.memtop", "--once", "--at", "2"], "replay", "args.at == 2.0"),
        (["report", "x.memtop", "-o", "r.html"], "report", "str(args.output) == 'r.html'"),
        (["compare", "a", "b", "--a-pid", "7"], "compare", "args.a_pid == 7"),
        (["attach", "42"], "attach", "args.pid == 42"),
    ):
        modules = imported_by(
            "from memtop.commands.parser import build_parser\n"
            f"args = build_parser().parse_args({argv!r})\n"
            f"assert args.command == {argv[0]!r} and {check}, args"
        )
        assert f"memtop.commands.{module}" in modules
        others = {"record", "replay", "report", "compare", "attach"} - {module}
        assert not {f"memtop.commands.{other}" for other in others} & modules


def test_the_filter_line_is_never_focused_on_the_way_to_the_first_frame() -> None:
    # Textual focuses a screen's first focusable widget as it composes it: that was the filter
    # line (hidden until `/`), and on_mount then moved the focus to the table.  The line's focus
    # and blur restyled it and ran its validation before the first frame (~20 ms of the start).
    import asyncio

    from textual.screen import Screen
    from ui_frozen import MY_UID, NOW, frozen_store

    from memtop.ui.app import MemtopApp
    from memtop.ui.widgets.process_table import ProcessTable

    focused: list[str] = []
    set_focus = Screen.set_focus

    def logged(self, widget, *args, **kwargs):  # type: ignore[no-untyped-def]
        focused.append(type(widget).__name__ if widget is not None else "None")
        return set_focus(self, widget, *args, **kwargs)

    async def run() -> None:
        app = MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.1)
            assert isinstance(app.focused, ProcessTable)
            started = list(focused)
            await pilot.press("slash")
            assert app.focused is app.filter_input  # `/` still focuses it at once
        assert started and set(started) == {"ProcessTable"}, started

    Screen.set_focus = logged  # type: ignore[method-assign]
    try:
        asyncio.run(run())
    finally:
        Screen.set_focus = set_focus  # type: ignore[method-assign]


def test_the_first_build_words_no_suggestion_for_a_pane_without_a_width(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The dashboard's first build runs before Textual's first layout: the suggestions worded for
    # no width (each line fitted and clipped to a "…") were worded again for the pane's width
    # before any line was drawn (CPU the first frame waited for, for nothing).
    import asyncio

    from ui_frozen import MY_UID, NOW, frozen_store

    from memtop.ui.app import MemtopApp
    from memtop.ui.widgets import suggestions

    widths: list[int | None] = []
    word = suggestions.suggestion_lines

    def logged(item, compact, width=None):  # type: ignore[no-untyped-def]
        widths.append(width)
        return word(item, compact, width)

    monkeypatch.setattr(suggestions, "suggestion_lines", logged)

    async def run() -> None:
        app = MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.1)
            pane = app.query_one(suggestions.SuggestionsPane)
            assert pane.items and len(pane._prompts) == len(pane.items)
            # Each drawn at the pane's width (the frozen screen's words: tests/test_ui_frozen.py).
            assert all(p.plain and p.plain.strip() != "…" for p in pane._prompts), pane._prompts
        assert widths and all(w is not None and w > 0 for w in widths), widths

    asyncio.run(run())


def test_the_first_gpu_cards_are_styled_once_dense_or_not(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A new card was made, given its `-dense` class (a restyle of it, alone) and then mounted
    # (styled again): the mixed demo's eight cards, dense at 36 rows, twice each before the
    # dashboard's first frame.  Now a new card is made with its class.
    import asyncio
    from dataclasses import replace

    from textual.app import App, ComposeResult
    from ui_helpers import a_gpu_row

    from memtop.ui.widgets import gpu_panel

    restyled: list[object] = []
    update = gpu_panel.GpuCard.update_node_styles

    def counted(self, animate=True):  # type: ignore[no-untyped-def]
        restyled.append(self)
        return update(self, animate)

    monkeypatch.setattr(gpu_panel.GpuCard, "update_node_styles", counted)
    rows = tuple(replace(a_gpu_row(), index=i, uuid=f"GPU-{i}") for i in range(8))

    class Panel(App[None]):
        def compose(self) -> ComposeResult:
            yield gpu_panel.GpuPanel(id="gpus")

    async def run() -> None:
        app = Panel()
        async with app.run_test(size=(120, 36)) as pilot:
            panel = app.query_one(gpu_panel.GpuPanel)
            panel.show(rows, dense=True)
            await pilot.pause()
            cards = list(app.query(gpu_panel.GpuCard))
            assert len(cards) == 8 and all(c.has_class("-dense") for c in cards)
            assert restyled == [], len(restyled)
            panel.show(rows, dense=False)  # a card that stays: its class changes in place
            assert not any(c.has_class("-dense") for c in cards) and len(restyled) == 8

    asyncio.run(run())


def test_the_dashboard_is_styled_once_before_its_first_frame() -> None:
    # Textual styles each widget as it mounts; the screen's first ScreenResume, just after,
    # restyled every node of it again (refresh_styles: for what changed while it was
    # suspended, at the start nothing), before the first frame, drawn within that handler.
    # A later resume (back from the help screen) still restyles the dashboard.
    import asyncio

    from textual import events
    from textual.app import App
    from ui_frozen import MY_UID, NOW, frozen_store

    from memtop.ui.app import DashboardScreen, MemtopApp
    from memtop.ui.screens.help import HelpScreen

    restyled: list[str] = []  # each restyle of the whole dashboard screen, and each frame
    update_styles, display = App.update_styles, App._display

    def logged_update(self, node, animate=True):  # type: ignore[no-untyped-def]
        if isinstance(node, DashboardScreen):
            restyled.append("screen")
        return update_styles(self, node, animate)

    def logged_display(self, screen, renderable):  # type: ignore[no-untyped-def]
        if renderable is not None:
            restyled.append("frame")
        return display(self, screen, renderable)

    async def run() -> None:
        app = MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            assert "frame" in restyled
            first = restyled.index("frame")
            assert "screen" not in restyled[:first], restyled
            restyled.clear()
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            await pilot.pause(0.1)
            assert isinstance(app.screen, DashboardScreen)
            app.screen.post_message(events.ScreenResume())  # as switching back to it posts
            await pilot.pause(0.1)
            assert "screen" in restyled, restyled

    App.update_styles, App._display = logged_update, logged_display  # type: ignore[method-assign]
    try:
        asyncio.run(run())
    finally:
        App.update_styles, App._display = update_styles, display  # type: ignore[method-assign]
