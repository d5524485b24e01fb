"""Shared fixtures: short private socket directories (AF_UNIX paths are limited to 108 bytes).

The suite runs in parallel: `python -m pytest -q -n 4 --dist loadfile` (README, .ci/run).  Each
test module runs in one worker, so a module-scoped fixture (a trainer, a 20 s recording, a
Prometheus) is made once and a test that checks what the others left (the fuzzed agent still
serves) sees it.  Not `--dist loadgroup`: with pytest 9.2, xdist 3.8 cannot rename a test's
node id, and its `xdist_group` marks are silently ignored."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The suite's torch trainers are tiny CPU models.  torch's intra-op threads (one per core) spin
# after each parallel region, and a trainer that sleeps between steps burned a second core for
# nothing: `memtop run examples/train_cpu.py` for 300 steps cost 4.9 CPU-s with them, 3.0 with
# one thread.  Four workers share the CI box's 2 cores; every torch process the suite starts
# (and the workers' own) inherits this unless the caller set it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# pytest's capture plugin imports readline in the controller, and readline, with no terminal,
# sets COLUMNS=80 and LINES=24, which the -n workers inherit: a dashboard started on a 120x36
# pty with this environment is laid out at 80x24 (Textual and Rich let them override the
# terminal's own size).  A test that needs a width sets it itself (test_cli_help).
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the modules handed out longest first (tests/helpers/
    module_seconds.py says why and how long each is): a worker that finishes its module takes
    the longest left, so the suite does not end on one long module that started last."""
    if config.getvalue("dist") != "loadfile":
        return None
    from helpers import module_seconds
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):
        return None  # an xdist whose scheduler is built otherwise: its own order, no worse
    seconds = module_seconds.load()

    class LongestFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node: Any) -> None:
            # The queue is whole by the first assignment (xdist's schedule() fills it, then
            # hands each worker its first module from it).
            if not self.ordered and isinstance(getattr(self, "workqueue", None), dict):
                self.ordered = True
                queue = sorted(
                    self.workqueue.items(),
                    key=lambda item: -module_seconds.weight(item[0], len(item[1]), seconds),
                )
                self.workqueue.clear()
                self.workqueue.update(queue)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="mt-"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def replay_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many lines memtop.sources.replay has parsed into an event, in [0] (a test sets it
    back to 0 between the readings it compares): a recording read twice shows as twice the
    parses of one reading."""
    import memtop.sources.replay as replay

    parsed = [0]
    agent_event = replay._agent_event

    def counted(*args: Any, **kwargs: Any) -> Any:
        parsed[0] += 1
        return agent_event(*args, **kwargs)

    monkeypatch.setattr(replay, "_agent_event", counted)
    return parsed


@pytest.fixture(autouse=True)
def _private_socket_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No test may see (or clean up) the sockets of real trainers on this machine.
    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(tmp_path / "no-agents-here"))


# Where the suite's time goes (README "Tests"): with MEMTOP_TEST_CPU_LOG=FILE, each test appends
# one JSON line: its wall seconds, this worker's CPU seconds and its reaped children's (every
# trainer, demo and CLI it started and waited for; a module-scoped fixture's teardown counts in
# its module's last test).  On a 2-core box the suite's wall is bound below by its CPU over 2, so
# the CPU column ranks what to make cheaper; the wall column ranks what waits.
CPU_LOG = os.environ.get("MEMTOP_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not CPU_LOG:
        yield
        return
    import json
    import resource
    import time

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    wall, own, children = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    line = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "wall_s": round(time.monotonic() - wall, 3),
        "cpu_s": round(cpu(resource.RUSAGE_SELF) - own, 3),
        "children_cpu_s": round(cpu(resource.RUSAGE_CHILDREN) - children, 3),
    }
    with open(CPU_LOG, "a") as log:
        log.write(json.dumps(line) + "\n")
