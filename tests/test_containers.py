"""A trainer in its own pid namespace (a container), the viewer outside (issue 25).

The trainer is a simulated one with the real agent, started under
`unshare --pid --fork --mount-proc`: inside, it is pid 1.  The socket directory is shared (as a
host path mounted into a pod would be).  The viewer must show it under the pid it sees (the
host's, the one the driver lists), joined with its GPU usage, and signal that process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_helpers import live_app, notifications, wait_for

from memtop.protocol import namespaces
from memtop.sim.demo import registry_dir
from memtop.sim.device import SimGpuRegistry, simulated_gpu_specs
from memtop.ui.screens.confirm import ConfirmScreen
from memtop.ui.widgets.process_table import ProcessTable

GiB = 2**30


def _unshare_problem() -> str | None:
    if os.geteuid() != 0:
        return "a new pid namespace needs root (CAP_SYS_ADMIN): runs as root in CI"
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0:
        return f"unshare --pid refused here: {done.stderr.decode(errors='replace').strip()}"
    return None


pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or _unshare_problem() is not None,
    reason=str(_unshare_problem() if sys.platform == "linux" else "Linux pid namespaces"),
)


class Contained:
    """A simulated trainer in a new pid namespace; `pid` is the pid this test sees."""

    def __init__(self, socket_dir: Path) -> None:
        self.registry = registry_dir(socket_dir, os.getpid())
        SimGpuRegistry(self.registry).create(simulated_gpu_specs(1, total_bytes=16 * GiB))
        env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
        self.unshare = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                sys.executable,
                "-m",
                "memtop.sim.trainer",
                "--registry",
                str(self.registry),
                "--step-time",
                "0.05",
            ],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        self.pid = -1
        try:
            self.pid = self._child()
            self.inside = namespaces.innermost_pid(self.pid)
            name = namespaces.expected_socket_name(self.pid)
            assert name is not None
            self.socket = socket_dir / name
            deadline = time.monotonic() + 60
            while not self.socket.exists():
                assert self.unshare.poll() is None, "the contained trainer died"
                assert time.monotonic() < deadline, f"no socket {self.socket}"
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def _child(self) -> int:
        deadline = time.monotonic() + 30
        path = f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children"
        while True:
            with open(path) as f:
                children = f.read().split()
            if children:
                return int(children[0])
            assert time.monotonic() < deadline, "unshare started no child"
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.unshare.poll() is None

    def stop(self) -> None:
        # The namespace's pid 1 first: everything in the namespace dies with it (unshare's own
        # death would leave it running; --kill-child is not in every util-linux).
        if self.pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.unshare.poll() is None:
            self.unshare.kill()
        self.unshare.wait(10)
        deadline = time.monotonic() + 10
        while self.pid > 0 and os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped by unshare, which waits for it
        shutil.rmtree(self.registry, ignore_errors=True)


@pytest.fixture
def contained(socket_dir: Path) -> Iterator[Contained]:
    trainer = Contained(socket_dir)
    try:
        yield trainer
    finally:
        trainer.stop()


def once_json(socket_dir: Path) -> dict:  # type: ignore[type-arg]
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), NO_COLOR="1")
    done = subprocess.run(
        [sys.executable, "-m", "memtop", "--once", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_contained_trainer_is_shown_under_the_host_pid_with_its_gpu_usage(
    contained: Contained, socket_dir: Path
) -> None:
    assert contained.inside == 1 and contained.pid != 1  # really in its own pid namespace
    assert contained.socket.name.startswith("1.ns")
    deadline = time.monotonic() + 30
    while True:
        data = once_json(socket_dir)
        agents = {a["pid"]: a for a in data["agents"]}
        if contained.pid in agents and agents[contained.pid]["devices"]:
            break
        assert time.monotonic() < deadline, data
        time.sleep(0.5)
    assert 1 not in agents  # never the pid the agent reports
    (device,) = data["devices"]
    used = {p["pid"]: p["used_bytes"] for p in device["processes"]}
    # The simulated driver lists the process under the host pid, as NVML does: joined.
    assert used.get(contained.pid, 0) > agents[contained.pid]["devices"][0]["reserved_bytes"] > 0
    assert list(used) == [contained.pid]


def test_kill_key_signals_the_host_process(contained: Contained, socket_dir: Path) -> None:
    app, sampler = live_app(socket_dir)

    def row_keys() -> list[int]:
        table = app.query_one(ProcessTable)
        return [r.pid for r in table.rows_by_key.values() if r.state == "agent"]

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: contained.pid in row_keys(), 30)
            table = app.query_one(ProcessTable)
            key = next(k for k, r in table.rows_by_key.items() if r.pid == contained.pid)
            table.move_cursor(row=table.get_row_index(key))
            await pilot.press("k")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("9")
            await wait_for(pilot, lambda: any("SIGKILL" in n for n in notifications(app)))
            await wait_for(pilot, lambda: not contained.alive(), 15)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    assert contained.unshare.returncode == 0 or not contained.alive()


def test_attach_into_a_container_refuses_in_one_line(contained: Contained) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "memtop", "attach", str(contained.pid), "--yes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"pid {contained.pid} runs in another pid namespace" in lines[0]
    assert "(pid 1 there)" in lines[0] and "inside the container" in lines[0]
    assert contained.alive()


def test_cleanup_by_host_pid_reaches_the_contained_agent(
    contained: Contained, socket_dir: Path
) -> None:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    deadline = time.monotonic() + 60
    while True:
        done = subprocess.run(
            [sys.executable, "-m", "memtop", "cleanup", str(contained.pid), "--wait", "20"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        # Reached: the agent answers; before the trainer's first step it says so (a loaded
        # box may take a while to get there).
        if done.returncode == 0 or "no training step has been seen" not in done.stderr:
            break
        assert time.monotonic() < deadline, done.stderr
        time.sleep(0.5)
    assert done.returncode == 0, done.stderr
    assert str(contained.pid) in done.stdout, done.stdout


def test_a_viewer_inside_the_container_sees_its_trainer_by_its_own_pid(socket_dir: Path) -> None:
    """Both in one new pid namespace (`docker exec memtop` beside the trainer): the agent's
    long socket name is this namespace's, so the viewer there reads it as a local pid."""
    # The simulated GPUs' registry is named after a pid alive in there (the shell, pid 1):
    # a viewer removes the registry of a demo it sees no more.
    registry = registry_dir(socket_dir, 1)
    SimGpuRegistry(registry).create(simulated_gpu_specs(1, total_bytes=16 * GiB))
    script = (
        f"{sys.executable} -m memtop.sim.trainer --registry {registry} --step-time 0.05 "
        "2>/dev/null & trainer=$!; "
        "for i in $(seq 300); do ls $MEMTOP_SOCKET_DIR | grep -q '^'$trainer'\\.ns' && break; "
        "sleep 0.1; done; "
        f"echo trainer=$trainer; {sys.executable} -m memtop --once --json; kill $trainer; wait"
    )
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
            capture_output=True,
            text=True,
            env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
            timeout=120,
        )
    finally:
        shutil.rmtree(registry, ignore_errors=True)
    first, _, rest = done.stdout.partition("\n")
    trainer = int(first.removeprefix("trainer="))
    assert trainer < 10  # its pid inside the namespace
    data = json.loads(rest)
    agents = {a["pid"]: a for a in data["agents"]}
    assert trainer in agents, data
    (device,) = data["devices"]
    assert [p["pid"] for p in device["processes"]] == [trainer]
