"""Python programs launched by a program under `memtop run` get an agent once they use torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memtop import protocol
from memtop.sources.agents import AgentClient

pytestmark = pytest.mark.slow
# A torch child's agent counting steps: 1-2 s on a quiet box; two suites in 4 workers each on 2
# cores took over 20 s (torch's import alone is ~1.1 s of CPU).  Not a budget: a bound.
TORCH_CHILD_WITHIN_S = 60

# The three children run until the test has looked at them (the file argv[1] names exists), so
# that the helper and the worker are alive when the test checks that they have no agent, and
# none runs on after: they each slept 6 s, which on a box where torch's import takes longer
# than that let the helper end before the check, and kept the child stepping ~5 s past it.
# STOP_AFTER_S bounds them if the test dies first.
STOP_AFTER_S = 120

CHILD = textwrap.dedent(
    f"""
    import os, sys, time
    import torch
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deadline = time.time() + {STOP_AFTER_S}
    while time.time() < deadline and not os.path.exists(sys.argv[1]):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.01)
    """
)

# What the helper and the worker run: wait for the stop file (`path`), importing nothing but
# the standard library.
WAIT = f"""
import os, time
deadline = time.time() + {STOP_AFTER_S}
while time.time() < deadline and not os.path.exists(path):
    time.sleep(0.1)
"""

PARENT = textwrap.dedent(
    f"""
    import subprocess, sys, multiprocessing as mp
    WAIT = {WAIT!r}
    def spawned(stop):
        exec(WAIT, {{"path": stop}})
    if __name__ == "__main__":
        stop = sys.argv[2]
        worker = mp.get_context("spawn").Process(target=spawned, args=(stop,))
        worker.start()
        print("worker", worker.pid, flush=True)
        helper = subprocess.Popen([sys.executable, "-c", f"path = {{stop!r}}" + WAIT])
        print("helper", helper.pid, flush=True)
        child = subprocess.Popen([sys.executable, sys.argv[1], stop])
        print("child", child.pid, flush=True)
        child.wait(); helper.wait(); worker.join()
    """
)


def alive(pid: int) -> bool:
    """Running, not only not yet reaped (its parent waits for it only at the end)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_children_that_use_torch_get_an_agent_and_others_do_not(socket_dir: Path, tmp_path: Path):
    pytest.importorskip("torch")  # the child trains a torch model
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    stop = tmp_path / "stop"
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memtop.cli",
            "run",
            str(tmp_path / "parent.py"),
            str(tmp_path / "child.py"),
            str(stop),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pids = {}
        for _ in range(3):
            role, pid = parent.stdout.readline().split()
            pids[role] = int(pid)
        deadline = time.monotonic() + TORCH_CHILD_WITHIN_S
        while time.monotonic() < deadline and pids["child"] not in protocol.list_agent_sockets(
            socket_dir
        ):
            time.sleep(0.1)
        with AgentClient(pids["child"], socket_dir, timeout=5) as client:
            hello = client.connect()
            assert hello.argv[0].endswith("child.py")
            # The optimizer hook counts its steps (once the child is past its imports).
            steps = []
            while time.monotonic() < deadline and len(set(steps)) < 3:
                steps.append(client.sample().step or 0)
                time.sleep(0.1)
            assert steps == sorted(steps) and steps[-1] > 0
        agents = set(protocol.list_agent_sockets(socket_dir))
        # Alive while looked at, or "no agent" would say nothing.
        assert all(alive(pids[role]) for role in ("helper", "worker", "child")), pids
        assert parent.pid in agents  # `memtop run` itself
        assert pids["helper"] not in agents  # never imported torch
        assert pids["worker"] not in agents  # a spawned multiprocessing worker
        stop.touch()
        assert parent.wait(30) == 0
    finally:
        stop.touch()
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_an_existing_sitecustomize_still_runs(socket_dir: Path, tmp_path: Path):
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS_RAN = True\n")
    script = tmp_path / "check.py"
    script.write_text(
        "import subprocess, sys\n"
        "code = 'import builtins; print(getattr(builtins, \"THEIRS_RAN\", False))'\n"
        "run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
        "print(run.stdout)\n"
    )
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), PYTHONPATH=str(theirs))
    result = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "run", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
