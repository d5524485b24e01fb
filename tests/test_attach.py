"""`memtop attach PID`: a plain `python examples/train_cpu.py` gets an agent without a restart
(real gdb, real ptrace); every refusal is one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from memtop.cli import main
from memtop.engine import attach

ROOT = Path(__file__).resolve().parent.parent
MEMTOP = [sys.executable, "-m", "memtop"]
needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")


def memtop(*args: str, socket_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    return subprocess.run(
        [*MEMTOP, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def once_json(socket_dir: Path) -> dict:
    """`memtop --once --json` run here, not in a new interpreter: what the agent shows after
    `memtop attach` (the attach itself runs as the user runs it).  Each polled report in a
    process of its own cost ~0.35 CPU-s of Python and memtop starting."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--once", "--json", "--socket-dir", str(socket_dir)]) == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def spawn(args: list[str], socket_dir: Path, **env: str) -> subprocess.Popen[str]:
    environment = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), **env)
    environment.pop("MEMTOP_AGENT", None)
    return subprocess.Popen(
        args, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.kill()
    return proc.communicate(timeout=10)


@pytest.fixture
def trainer(socket_dir: Path) -> Iterator[subprocess.Popen[str]]:
    pytest.importorskip("torch")  # examples/train_cpu.py is a torch trainer
    # Plain python: no memtop in its code, not under memtop run.
    proc = spawn(
        [sys.executable, "examples/train_cpu.py", "--step-time", "0.02", "--device", "cpu"],
        socket_dir,
    )
    assert proc.stdout is not None
    try:
        proc.stdout.readline()  # "step 100 ...": torch imported, the optimizer stepping
        yield proc
    finally:
        stop(proc)


@pytest.fixture
def sleeper(socket_dir: Path) -> Iterator[subprocess.Popen[str]]:
    proc = spawn([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"], socket_dir)
    time.sleep(0.3)
    try:
        yield proc
    finally:
        stop(proc)


def agent_step(socket_dir: Path, pid: int) -> int | None:
    data = once_json(socket_dir)
    steps = [a["step"] for a in data["agents"] if a["pid"] == pid and a["state"] == "connected"]
    return steps[0] if steps else None


STEPS_SEEN_WITHIN_S = 30


@pytest.mark.slow
@needs_gdb
def test_attach_to_a_plain_trainer_shows_moving_steps(trainer, socket_dir: Path):
    result = memtop("attach", str(trainer.pid), socket_dir=socket_dir)
    assert result.returncode == 0, result.stderr
    assert f"attached to pid {trainer.pid}" in result.stdout and "with gdb" in result.stdout
    # The agent counts the next step boundary (under a second on a quiet box); the bound is
    # the box's, not memtop's: two suites at once on 2 cores slow every process here.
    started = time.monotonic()
    first = None
    while time.monotonic() - started < STEPS_SEEN_WITHIN_S:
        first = agent_step(socket_dir, trainer.pid)
        if first:
            break
        time.sleep(0.2)
    assert first, f"the agent counts no steps within {STEPS_SEEN_WITHIN_S} s of memtop attach"
    time.sleep(1.0)
    second = agent_step(socket_dir, trainer.pid)
    assert second is not None and second > first
    data = once_json(socket_dir)
    (agent,) = data["agents"]
    assert agent["argv"][0] == "examples/train_cpu.py"  # the trainer's own argv
    assert agent["torch"]  # torch was already imported: the probe took it at once

    # Twice is a no-op: the agent already listening is reported, not doubled.
    again = memtop("attach", str(trainer.pid), socket_dir=socket_dir)
    assert again.returncode == 0
    assert "already has an agent" in again.stdout
    assert sorted(p.name for p in socket_dir.glob("*.sock")) == [f"{trainer.pid}.sock"]
    _, err = stop(trainer)
    assert err.count("memtop: agent listening") == 1


@pytest.mark.slow
@needs_gdb
def test_attach_without_memtop_in_the_target_adds_this_one(socket_dir: Path):
    # -I -S: no site-packages, no cwd on sys.path: only the path memtop appends finds memtop.
    program = "import time\nwhile True: time.sleep(0.05)"
    proc = spawn([sys.executable, "-I", "-S", "-c", program], socket_dir)
    try:
        time.sleep(0.3)
        target = attach.inspect(proc.pid)
        assert not target.has_memtop and target.version == sys.version_info[:2]
        result = memtop("attach", str(proc.pid), socket_dir=socket_dir)
        assert result.returncode == 0, result.stderr
        data = once_json(socket_dir)
        (agent,) = [a for a in data["agents"] if a["pid"] == proc.pid]
        assert agent["torch"] is None  # a program without torch: none was imported for it
    finally:
        stop(proc)


# ------------------------------------------------------------------ refusals, one line each


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["attach", *args])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("memtop: ") and err.count("\n") == 1, err
    return err


def test_no_such_process(capsys):
    assert "no process 999999999" in refused(capsys, "999999999")


def test_not_a_python_process(capsys, socket_dir: Path):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert "is not a Python process" in refused(capsys, str(proc.pid))
    finally:
        proc.kill()
        proc.wait()


def test_gdb_missing(capsys, sleeper, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it: no gdb
    assert "gdb is not installed" in refused(capsys, str(sleeper.pid))


@pytest.mark.parametrize(
    ("scope", "cap", "says"),
    [
        ("1", False, "kernel.yama.ptrace_scope = 1"),
        ("2", False, "kernel.yama.ptrace_scope = 2"),
        ("3", True, "ptrace is disabled on this machine"),
    ],
)
def test_ptrace_forbidden(capsys, sleeper, monkeypatch, tmp_path: Path, scope, cap, says):
    scope_file = tmp_path / "ptrace_scope"
    scope_file.write_text(scope + "\n")
    monkeypatch.setattr(attach, "YAMA_PTRACE_SCOPE", scope_file)
    status = tmp_path / "status"
    status.write_text(
        f"Name:\tmemtop\nCapEff:\t{'0000000000080000' if cap else '0000000000000000'}\n"
    )
    monkeypatch.setattr(attach, "SELF_STATUS", status)
    assert attach.has_cap_sys_ptrace() is cap
    assert says in refused(capsys, str(sleeper.pid))


def test_ptrace_scope_1_with_the_capability_goes_on(sleeper, monkeypatch, tmp_path: Path):
    scope_file = tmp_path / "ptrace_scope"
    scope_file.write_text("1\n")
    monkeypatch.setattr(attach, "YAMA_PTRACE_SCOPE", scope_file)
    monkeypatch.setattr(attach, "has_cap_sys_ptrace", lambda: True)
    attach.check_ptrace(attach.inspect(sleeper.pid))  # no refusal


def test_kernel_refusal_seen_by_gdb_is_one_line():
    output = (
        "Could not attach to process.  If your uid matches...\nptrace: Operation not permitted.\n"
    )
    why = attach.gdb_failure(output)
    assert why is not None and "refused ptrace" in why and "\n" not in why
    assert attach.gdb_failure("$1 = 1\n$2 = 0\n") is None
    assert "raised inside the target" in (attach.gdb_failure("$1 = 1\n$2 = -1\n") or "")


def test_python_version_mismatch_without_memtop_there(capsys, sleeper, monkeypatch):
    def other_python(target: attach.Target) -> None:
        target.version, target.has_memtop = (3, 10), False

    monkeypatch.setattr(attach, "_probe_environment", other_python)
    err = refused(capsys, str(sleeper.pid))
    assert "memtop is not installed in the environment of pid" in err
    assert "Python 3.10" in err and "-m pip install memtop-gpu" in err


def test_remote_debugging_disabled_on_3_14(capsys, socket_dir: Path, monkeypatch):
    proc = spawn(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"],
        socket_dir,
        PYTHON_DISABLE_REMOTE_DEBUG="1",
    )
    try:
        time.sleep(0.3)

        def python_3_14(target: attach.Target) -> None:
            target.version, target.has_memtop = (3, 14), True

        monkeypatch.setattr(attach, "_probe_environment", python_3_14)
        assert "disabled remote debugging" in refused(capsys, str(proc.pid))
    finally:
        stop(proc)


def test_the_path_appended_in_the_target_holds_this_memtop():
    assert (Path(attach.MEMTOP_PARENT) / "memtop" / "__init__.py").samefile(
        Path(attach.__file__).parents[1] / "__init__.py"
    )


def test_the_injected_code_binds_nothing_and_never_raises(tmp_path: Path):
    # Run it as gdb would (one statement in __main__) in a fresh interpreter whose memtop import
    # fails: it says so on stderr, the program goes on, and __main__ gains no name.
    code = attach.injected_code(str(tmp_path / "no-memtop-here"))
    program = (
        "import sys, time\nsys.modules['memtop'] = None\nbefore = set(globals())\n"
        f"exec({code!r}, globals())\ntime.sleep(0.5)\n"
        "print(sorted(set(globals()) - before - {'before'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", program], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "[]"
    assert "memtop: agent not started" in result.stderr


# ------------------------------------------------------------------ the dashboard's `a`


class OneGpuListing:
    """A driver that lists one process on one GPU (the machine has no GPU: a stand-in)."""

    def __init__(self, pid: int) -> None:
        from memtop.model import DeviceReading, DriverReading, GpuProcess

        device = DeviceReading(
            0,
            "GPU-attach-test",
            "Stand-in GPU",
            80 << 30,
            3 << 30,
            processes=(GpuProcess(pid, 2 << 30),),
        )
        self.reading = DriverReading(available=True, devices=(device,), driver_version="test")

    def read(self):  # type: ignore[no-untyped-def]
        return self.reading

    def close(self) -> None:
        pass


@pytest.mark.slow
@needs_gdb
def test_dashboard_a_attaches_to_a_driver_listed_process_after_asking(trainer, socket_dir):
    import asyncio

    from ui_helpers import notifications, wait_for

    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.ui.app import MemtopApp
    from memtop.ui.screens.confirm import ConfirmScreen
    from memtop.ui.widgets.process_table import ProcessTable

    store = Store()
    sampler = Sampler(store, OneGpuListing(trainer.pid), AgentPool(socket_dir), interval=0.25)
    app = MemtopApp(store, sampler, interval=0.25)

    def states() -> set[str]:
        rows = app.query_one(ProcessTable).rows_by_key.values()
        return {r.state for r in rows if r.pid == trainer.pid}

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: states() == {"no agent"})
            await pilot.press("a")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")  # asked first: no means no
            assert not isinstance(app.screen, ConfirmScreen)
            await pilot.pause(0.5)
            assert not (socket_dir / f"{trainer.pid}.sock").exists()
            await pilot.press("a", "y")
            # The stand-in GPU is not the CPU trainer's, so its agent gets a row of its own.
            await wait_for(pilot, lambda: "agent" in states(), timeout=30)
            # The row can come first: the sampler finds the new socket while gdb detaches,
            # and each round is drawn as it lands; the attach's own message follows.
            await wait_for(
                pilot,
                lambda: any(f"attached to pid {trainer.pid}" in n for n in notifications(app)),
                timeout=30,
            )
            await pilot.press("a")  # now it has one: said, not asked
            assert not isinstance(app.screen, ConfirmScreen)
            assert any("already has a memtop agent" in n for n in notifications(app))

    try:
        asyncio.run(main())
    finally:
        sampler.stop()


def test_gdb_reads_nothing_of_anyones_and_runs_from_the_root(monkeypatch, sleeper):
    # gdb runs as memtop's user (root, maybe) on files the target's user may own: no init file,
    # no auto-loaded script, no debuginfod, not from the current directory.
    seen: dict[str, object] = {}

    def run(command, **kwargs):  # type: ignore[no-untyped-def]
        seen["command"], seen["cwd"] = command, kwargs.get("cwd")
        return subprocess.CompletedProcess(command, 0, "$1 = 1\n$2 = 0\n", "")

    monkeypatch.setattr(attach.subprocess, "run", run)
    attach._gdb_inject(attach.inspect(sleeper.pid), "pass")
    command = seen["command"]
    assert isinstance(command, list) and "-nx" in command
    early = [command[i + 1] for i, arg in enumerate(command) if arg == "-iex"]
    assert "set auto-load off" in early and "set debuginfod enabled off" in early
    assert seen["cwd"] == "/"


@pytest.mark.parametrize("as_root", [True, False])
def test_an_unreadable_process_is_refused_truthfully(capsys, sleeper, monkeypatch, as_root):
    # `memtop attach 1` as root said "attach as its user (or root)": it was root.
    def forbidden(path):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied", str(path))

    me = 0 if as_root else 4321  # who memtop runs as, and whose the process is
    monkeypatch.setattr(attach.os, "readlink", forbidden)
    monkeypatch.setattr(attach.os, "geteuid", lambda: me)
    monkeypatch.setattr(attach.Path, "stat", lambda self: SimpleNamespace(st_uid=me))
    err = refused(capsys, str(sleeper.pid))
    assert f"/proc/{sleeper.pid}/exe" in err and "(or root)" not in err
    if as_root:
        assert "the kernel does not let root read" in err and "cannot attach to it" in err
    else:
        assert "although the process is yours" in err and "try memtop attach as root" in err


def test_pid_1_as_root_when_the_kernel_hides_it(capsys):
    if os.geteuid() != 0:
        pytest.skip("root only")
    try:
        os.readlink("/proc/1/exe")
    except PermissionError:
        pass
    else:
        pytest.skip("/proc/1 is readable here")
    err = refused(capsys, "1")
    assert "the kernel does not let root read /proc/1/exe" in err and "(or root)" not in err


def test_actions_without_an_agent_suggest_attach_too(sleeper, socket_dir: Path):
    for command in (["cleanup"], ["snapshot", "-o", str(socket_dir / "x.pickle")]):
        result = memtop(command[0], str(sleeper.pid), *command[1:], socket_dir=socket_dir)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert "memtop run" in result.stderr
        assert f"memtop attach {sleeper.pid}" in result.stderr
    gone = memtop("cleanup", "999999999", socket_dir=socket_dir)
    assert gone.returncode == 1 and "no process 999999999" in gone.stderr


@pytest.mark.parametrize("trap", ["flood", "hang"])
def test_the_probe_is_bounded_in_size_and_time(tmp_path: Path, monkeypatch, trap: str):
    # The probe runs the target's interpreter, whose site-packages belong to the target's user:
    # a .pth there that floods stdout or hangs (armed once the target runs: only the probe
    # trips it) costs memtop at most PROBE_OUTPUT_LIMIT bytes and PROBE_TIMEOUT_S seconds.
    armed = tmp_path / "armed"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    action = (
        "sys.stdout.write('x' * (1 << 26)), sys.stdout.flush()"
        if trap == "flood"
        else "__import__('time').sleep(60)"
    )
    (site / "trap.pth").write_text(
        f"import os, sys; os.path.exists({str(armed)!r}) and ({action})\n"
    )
    proc = subprocess.Popen([str(venv / "bin" / "python"), "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(attach, "PROBE_TIMEOUT_S", 3.0)
    try:
        time.sleep(0.3)
        armed.touch()
        started = time.monotonic()
        target = attach.inspect(proc.pid)
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    assert elapsed < 3.0 + 2.0, elapsed
    assert target.problems == [f"could not ask {venv / 'bin' / 'python'} about memtop (no answer)"]
    assert target.version == sys.version_info[:2]  # from /proc: what the probe could not say


@pytest.mark.slow
@needs_gdb
def test_attach_stacks_on_a_cpu_trainer_says_it_waits_for_a_cuda_device(trainer, socket_dir: Path):
    # CPU torch records no allocator history: attached, asked, and told the truth about when.
    result = memtop("attach", "--stacks", str(trainer.pid), socket_dir=socket_dir)
    assert result.returncode == 0, result.stderr
    attached, asked = result.stdout.strip().splitlines()
    assert f"attached to pid {trainer.pid}" in attached
    assert f"stack recording asked in pid {trainer.pid}, which uses no CUDA device" in asked


@pytest.mark.slow
def test_attach_stacks_switches_them_on_in_a_trainer_that_can(socket_dir: Path):
    # A simulated trainer (its agent already there): --stacks asks, and its sites show up in
    # --once --json, with the leak scenario's own line among them.
    from memtop.sim.demo import Demo

    with Demo(gpus=1, scenario="leak", step_time=0.02, socket_dir=socket_dir) as demo:
        assert demo.wait_ready(30)
        pid = demo.processes[0].pid
        before = once_json(socket_dir)
        assert [a["sites"] for a in before["agents"] if a["pid"] == pid] == [[]]
        result = memtop("attach", "--stacks", "--yes", str(pid), socket_dir=socket_dir)
        assert result.returncode == 0, result.stderr
        assert "already has an agent" in result.stdout
        assert f"stack recording asked in pid {pid}" in result.stdout
        sites: list = []
        deadline = time.monotonic() + 30
        while not sites and time.monotonic() < deadline:
            time.sleep(0.3)  # a report here costs ~0.1 CPU-s, not a new interpreter's 0.35
            data = once_json(socket_dir)
            sites = [s for a in data["agents"] if a["pid"] == pid for s in a["sites"]]
        assert any("leak_bytes_per_step" in s["site"]["text"] for s in sites), sites
