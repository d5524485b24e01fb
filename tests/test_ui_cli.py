"""`memtop demo` and `memtop` open the dashboard on a terminal; quitting stops the demo's
trainers.  Run in a real pseudo-terminal, as a user would."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import default_sigint

from memtop import protocol
from memtop.base import children

pytestmark = pytest.mark.slow


def spawn_in_pty(args: list[str], socket_dir: Path, size: tuple[int, int] = (120, 36)):  # type: ignore[no-untyped-def]
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), TERM="xterm-256color")
    command = [sys.executable, "-m", "memtop", *args]
    return children.start_in_terminal(command, size, env, preexec_fn=default_sigint)


def read_until(master: int, needle: bytes | None, timeout: float = 30.0) -> bytes:
    """What the pty says until `needle` is in it (an AssertionError if it is not by
    `timeout`); with None, all it says in `timeout` seconds."""
    seen = b""
    deadline = time.monotonic() + timeout
    while needle is None or needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            if needle is None:
                break
            raise AssertionError(f"{needle!r} not seen; last output: {seen[-400:]!r}")
        ready, _, _ = select.select([master], [], [], min(left, 0.2))
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    return seen


def read_for(master: int, seconds: float) -> bytes:
    return read_until(master, None, seconds)


def read_to_exit(master: int, process: subprocess.Popen[bytes], timeout: float = 15.0) -> bytes:
    """Everything the process writes until it exits, and what is still in the pty after: a
    process that exits before the first look must not read as silent."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = process.poll() is None
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the slave side is closed and drained
                break
            if not chunk:
                break
            out += chunk
        elif not running:
            break  # exited, and nothing more came
    # The pty closes as the process exits, a moment before it can be reaped.
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(0.1, deadline - time.monotonic()))
    return out


def drain(master: int, process: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            with contextlib.suppress(OSError):
                os.read(master, 65536)
    if process.poll() is None:
        process.kill()
        raise AssertionError("the dashboard did not quit on q")
    return process.returncode


def test_demo_opens_the_dashboard_and_quit_stops_trainers(socket_dir: Path) -> None:
    # One healthy demo for two checks (each a demo, its trainer and a dashboard to start): the
    # dashboard and the quit that takes the trainers down, and a quiet demo leaves no log.
    process, master = spawn_in_pty(["demo", "--gpus", "1", "--scenario", "healthy"], socket_dir)
    try:
        # The header is up while the trainers start: the very first bytes.
        from memtop.ui import splash

        first = read_until(master, b"starting", timeout=30)
        assert first.startswith(splash.ENTER.encode())
        seen = first + read_until(master, b"sim_train.py", timeout=60)  # the trainer's row
        assert seen.count(splash.ENTER.encode()) == 1  # painted once, not again by the dashboard
        assert protocol.list_agent_sockets(socket_dir, remove_stale=False)
        os.write(master, b"q")
        after_quit = read_to_exit(master, process)
        assert process.returncode == 0, f"q: exit {process.returncode} (None: did not quit)"
        # The demo took its trainers down with it: no agent socket, no simulated GPU left.
        assert not protocol.list_agent_sockets(socket_dir, remove_stale=False)
        assert not list(socket_dir.glob("sim-*"))
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    # A quiet demo leaves no log, and says nothing of one once the terminal is back.
    assert not list((socket_dir / "demo").glob("*.log")) and b"messages" not in after_quit


def test_the_trainers_messages_go_to_a_log_not_over_the_dashboard(socket_dir: Path) -> None:
    # The oom demo's trainer says "OOM at step N, batch halved: ..." every few steps; on the
    # terminal those lines were drawn over the dashboard.
    process, master = spawn_in_pty(
        ["demo", "--gpus", "1", "--scenario", "oom", "--step-time", "0.05"], socket_dir
    )
    log_dir = socket_dir / "demo"  # the state directory, with MEMTOP_SOCKET_DIR set
    try:
        seen = read_until(master, b"sim_train.py", timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and b"batch halved" not in b"".join(
            p.read_bytes() for p in log_dir.glob("demo-*.log")
        ):
            seen += read_for(master, 0.3)
        seen += read_for(master, 2.0)  # a few more frames with OOMs coming
        os.write(master, b"q")
        seen += read_to_exit(master, process)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    assert b"batch halved" not in seen and b"[pid " not in seen
    (log,) = log_dir.glob("demo-*.log")
    assert log.name == f"demo-{process.pid}.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    assert b"OOM at step" in log.read_bytes()
    # Told where they went, once the terminal is back.
    assert b"messages (" in seen and str(log).encode() in seen


def test_dashboard_with_nothing_to_show_explains_itself(socket_dir: Path) -> None:
    from memtop.sources.nvml import NvmlSource

    source = NvmlSource()
    try:
        if source.read().available:
            pytest.skip("this machine has GPUs: the dashboard is not empty here")
    finally:
        source.close()
    process, master = spawn_in_pty([], socket_dir, size=(80, 24))
    try:
        out = read_until(master, b"memtop demo", timeout=30)
        assert b"No GPUs and no PyTorch" in out
        os.write(master, b"q")
        assert drain(master, process) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


def test_header_is_painted_before_textual_and_the_terminal_is_given_back(socket_dir: Path) -> None:
    from memtop.ui import splash

    process, master = spawn_in_pty([], socket_dir, size=(80, 24))
    try:
        first = read_until(master, b"starting", timeout=30)
        # The very first bytes: the alternate screen, then the header row — no Textual yet.
        assert first.startswith(splash.ENTER.encode())
        assert b" memtop " in first and os.uname().nodename.encode() in first
        read_until(master, b"memtop demo", timeout=30)  # Textual's own frame followed
        os.write(master, b"q")
        tail = read_to_exit(master, process)
        assert process.wait(timeout=5) == 0
        assert tail.endswith(splash.LEAVE.encode())  # back on the normal screen, cursor shown
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


def test_interrupted_while_starting_leaves_the_alternate_screen(socket_dir: Path) -> None:
    from memtop.ui import splash

    process, master = spawn_in_pty([], socket_dir, size=(80, 24))
    try:
        read_until(master, b"starting", timeout=30)
        # Ctrl-C, most likely while Textual is still importing.
        os.killpg(process.pid, signal.SIGINT)
        out = read_to_exit(master, process)
        assert process.poll() is not None, "memtop did not stop on Ctrl-C"
        assert splash.LEAVE.encode() in out and b"Traceback" not in out
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


def test_no_splash_on_a_dumb_terminal_or_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtop.ui import splash

    master, slave = os.openpty()
    try:
        monkeypatch.setenv("TERM", "dumb")
        assert not splash.paint(slave)
        monkeypatch.setenv("TERM", "xterm-256color")
        assert splash.paint(slave, colour=False)
        written = os.read(master, 4096)
        assert b"\x1b[7m memtop " in written and b"\x1b[1;30;46m" not in written  # monochrome
    finally:
        os.close(master)
        os.close(slave)
    r, w = os.pipe()
    try:
        assert not splash.paint(w)  # not a terminal: nothing written
    finally:
        os.close(r)
        os.close(w)


def test_the_header_is_undone_once_and_only_when_it_was_painted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pty

    from memtop.ui import splash

    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("MEMTOP_NO_SPLASH", raising=False)
    monkeypatch.setattr(splash, "_shown", False)  # whatever an earlier test painted
    master, slave = pty.openpty()
    try:
        splash.restore(slave)  # nothing painted: nothing to undo
        assert splash.paint(slave)
        assert splash.ENTER.encode() in os.read(master, 4096)
        # The callers restore in `finally` whether or not they saw paint return (a Ctrl-C can
        # land as the write returns): the first restore leaves, a second changes nothing.
        splash.restore(slave)
        splash.restore(slave)
        os.write(slave, b"end")
        # One read may return before the pty has passed on the last write: read up to "end".
        said = b""
        deadline = time.monotonic() + 10
        while not said.endswith(b"end") and time.monotonic() < deadline:
            said += os.read(master, 4096)
        assert said == splash.LEAVE.encode() + b"end"
    finally:
        os.close(master)
        os.close(slave)


def test_the_first_figures_are_on_screen_before_textuals_first_frame(socket_dir: Path) -> None:
    """Start-up (issue 21, DESIGN §9): the first sampling round runs while Textual is imported,
    and its figures (every GPU's line, every agent's row) are painted under the header as soon
    as they are known, before Textual's first frame (its "Processes" panel).  They waited for
    Textual's frame and then a round: data at 0.77-1.06 s where nvitop draws at 0.12-0.24 s."""
    from memtop.sim.demo import Demo
    from memtop.ui import splash

    # A step every 0.5 s: what is painted, and when, is asked of them, not their pace.
    demo = Demo(gpus=2, scenario="healthy", step_time=0.5, socket_dir=socket_dir)
    process = master = None
    try:
        pids = demo.start()
        assert demo.wait_ready(60)
        # The order is what is tested, not the speed: on a loaded box (two suites at once) the
        # first round can take longer than the 0.3 s Textual's import waits for it.
        os.environ["MEMTOP_FIRST_ROUND_WAIT_S"] = "20"
        try:
            process, master = spawn_in_pty([], socket_dir)
        finally:
            del os.environ["MEMTOP_FIRST_ROUND_WAIT_S"]
        before_textual = read_until(master, b"Processes", timeout=60)
        text = before_textual.decode(errors="replace")
        assert text.startswith(splash.ENTER)
        for gpu in (0, 1):
            assert f"GPU {gpu}  Simulated H100" in text, text[-800:]
        rows = [line for line in text.split("\x1b[") if "sim_train.py --scenario=healthy" in line]
        assert len(rows) == 2, text[-800:]
        assert all(f" {pid} " in text for pid in pids)
        os.write(master, b"q")
        assert drain(master, process) == 0
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        if master is not None:
            os.close(master)
        demo.stop()


def test_no_figures_are_painted_once_textual_has_the_terminal(monkeypatch: pytest.MonkeyPatch):
    from memtop.ui import splash

    monkeypatch.setattr(splash, "_shown", True)  # as after `paint`
    monkeypatch.setattr(splash, "_handed_over", False)
    read, write = os.pipe()
    try:
        assert splash.paint_figures(write, ["GPU 0  x"])
        assert os.read(read, 100).endswith(b"GPU 0  x")
        splash.hand_over()
        assert not splash.paint_figures(write, ["GPU 0  y"])  # Textual's frames are its own
    finally:
        os.close(read)
        os.close(write)
