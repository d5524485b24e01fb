"""`memtop run` as a drop-in for `python`: sys.path, exit codes, tracebacks, torch loaded lazily."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import memtop
from memtop import protocol
from memtop.sources.agents import AgentClient

MEMTOP = [sys.executable, "-m", "memtop"]
# A torch child's agent counting steps: 1-2 s on a quiet box; two suites in 4 workers each on 2
# cores took over 20 s (torch's import alone is ~1.1 s of CPU).  Not a budget: a bound.
TORCH_CHILD_WITHIN_S = 60


def run(args: list[str], cwd: Path, socket_dir: Path, timeout: float = 60, **env: str):
    environment = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), **env)
    environment.pop("MEMTOP_AGENT", None)
    return subprocess.run(
        args, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helper.py").write_text("VALUE = 'from pkg.helper'\n")
    # Imports a sibling module the way a package's entry point does: needs sys.path[0] = cwd.
    (tmp_path / "pkg" / "train.py").write_text(
        textwrap.dedent(
            """
            import sys
            from pkg.helper import VALUE
            print(VALUE)
            print("path0", sys.path[0])
            print("argv", sys.argv[1:])
            print("torch loaded", "torch" in sys.modules)
            """
        )
    )
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "lib.py").write_text("NAME = 'lib beside the script'\n")
    (tmp_path / "scripts" / "main.py").write_text(
        "import sys\nimport lib\nprint(lib.NAME)\nprint('path0', sys.path[0])\n"
        "print('torch loaded', 'torch' in sys.modules)\n"
    )
    (tmp_path / "bad.py").write_text(
        "def inner():\n    raise ValueError('boom')\n\n\ndef outer():\n    inner()\n\n\nouter()\n"
    )
    (tmp_path / "empty_dir").mkdir()
    return tmp_path


def test_dash_m_runs_like_python_dash_m(project: Path, socket_dir: Path):
    ours = run([*MEMTOP, "run", "-m", "pkg.train", "a", "--b"], project, socket_dir)
    theirs = run([sys.executable, "-m", "pkg.train", "a", "--b"], project, socket_dir)
    assert theirs.returncode == 0, theirs.stderr
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == theirs.stdout
    assert f"path0 {project}" in ours.stdout
    # The agent started, and torch was not imported for a program that never imports it.
    assert "torch loaded False" in ours.stdout
    assert "agent listening" in ours.stderr


def test_script_path_gets_its_folder_first_on_sys_path(project: Path, socket_dir: Path):
    ours = run([*MEMTOP, "run", "scripts/main.py"], project, socket_dir)
    assert ours.returncode == 0, ours.stderr
    assert "lib beside the script" in ours.stdout
    assert f"path0 {project / 'scripts'}" in ours.stdout
    assert "torch loaded False" in ours.stdout


def test_missing_script_exits_2_like_python(project: Path, socket_dir: Path):
    ours = run([*MEMTOP, "run", "nosuch.py"], project, socket_dir)
    theirs = run([sys.executable, "nosuch.py"], project, socket_dir)
    assert ours.returncode == theirs.returncode == 2
    assert ours.stderr.count("\n") == 1
    assert "can't open file" in ours.stderr and str(project / "nosuch.py") in ours.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-m", "nosuchmod"], "No module named nosuchmod"),
        (["-m", "pkg"], "'pkg' is a package and cannot be directly executed"),
        (["empty_dir"], "can't find '__main__' module in"),
    ],
)
def test_targets_python_cannot_run_get_one_line(project, socket_dir, args, says):
    ours = run([*MEMTOP, "run", *args], project, socket_dir)
    theirs = run([sys.executable, *args], project, socket_dir)
    assert ours.returncode == theirs.returncode == 1
    assert says in ours.stderr and says in theirs.stderr
    assert ours.stderr.count("\n") == 1, ours.stderr
    assert "Traceback" not in ours.stderr


def test_user_traceback_has_no_memtop_or_runpy_frames(project: Path, socket_dir: Path):
    ours = run([*MEMTOP, "run", "bad.py"], project, socket_dir)
    theirs = run([sys.executable, "bad.py"], project, socket_dir)
    assert ours.returncode == theirs.returncode == 1
    frames = [line for line in ours.stderr.splitlines() if line.startswith('  File "')]
    assert len(frames) == 3, ours.stderr  # <module>, outer, inner: the program's own
    assert all("bad.py" in frame for frame in frames)
    # Keyed on the package's folder, not on "memtop/": a clone named memtop holds the tests.
    package = str(Path(memtop.__file__).resolve().parent)
    assert "runpy" not in ours.stderr and package not in ours.stderr
    assert ours.stderr.splitlines()[-1] == "ValueError: boom"
    assert theirs.stderr.splitlines()[-1] == "ValueError: boom"


def test_missing_torch_says_where_memtop_belongs(project: Path, socket_dir: Path):
    (project / "needs_torch.py").write_text("import torch\n")
    # memtop's environment without torch: make `import torch` fail as it would there.
    code = (
        "import sys; sys.modules['torch'] = None; from memtop.cli import main; "
        "sys.exit(main(['run', 'needs_torch.py']))"
    )
    ours = run([sys.executable, "-c", code], project, socket_dir)
    assert ours.returncode == 1
    assert "memtop.cli" not in ours.stderr and "runpy" not in ours.stderr
    last = ours.stderr.splitlines()[-1]
    assert "install memtop into the trainer's environment" in last
    assert sys.executable in last


def test_agent_counts_steps_once_the_program_imports_torch(project: Path, socket_dir: Path):
    pytest.importorskip("torch")
    (project / "late_torch.py").write_text(
        textwrap.dedent(
            """
            import sys, time
            print("before", "torch" in sys.modules, flush=True)
            time.sleep(1.0)  # a program that does other things first
            import torch
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(400):
                opt.zero_grad()
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                time.sleep(0.01)
            """
        )
    )
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    proc = subprocess.Popen(
        [*MEMTOP, "run", "late_torch.py"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + TORCH_CHILD_WITHIN_S
        step = None
        while time.monotonic() < deadline:
            if protocol.list_agent_sockets(socket_dir) and proc.poll() is None:
                with AgentClient(proc.pid, socket_dir, timeout=5) as client:
                    hello = client.connect()
                    sample = client.request("sample")
                step = sample.get("step")
                if step and hello.torch:
                    break
            time.sleep(0.3)
        assert step and step > 0, "steps were not counted after the program imported torch"
    finally:
        proc.kill()
        out, _ = proc.communicate()
    assert "before False" in out


def test_hello_script_starts_quickly(project: Path, socket_dir: Path):
    # The agent starts without importing torch: a torch-free script pays memtop's import only.
    (project / "hello.py").write_text("print('hello')\n")

    def best(args: list[str]) -> float:
        # The child's CPU time, not the wall clock: the same on a busy box (the suite runs in
        # parallel workers, and two suites may share the machine).
        times = []
        for _ in range(3):
            started = resource.getrusage(resource.RUSAGE_CHILDREN)
            result = run(args, project, socket_dir)
            ended = resource.getrusage(resource.RUSAGE_CHILDREN)
            times.append(ended.ru_utime + ended.ru_stime - started.ru_utime - started.ru_stime)
            assert result.returncode == 0 and "hello" in result.stdout, result.stderr
        return min(times)

    ours = best([*MEMTOP, "run", "hello.py"])
    theirs = best([sys.executable, "hello.py"])
    assert ours - theirs < 0.3, (ours, theirs)
