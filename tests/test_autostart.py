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

CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deadline = time.time() + float(sys.argv[1])
    while time.time() < deadline:
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.01)
    """
)

PARENT = textwrap.dedent(
    """
    import subprocess, sys, multiprocessing as mp
    def spawned(seconds):
        import time
        time.sleep(seconds)
    if __name__ == "__main__":
        worker = mp.get_context("spawn").Process(target=spawned, args=(6,))
        worker.start()
        print("worker", worker.pid, flush=True)
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(6)"])
        print("helper", helper.pid, flush=True)
        child = subprocess.Popen([sys.executable, sys.argv[1], "6"])
        print("child", child.pid, flush=True)
        child.wait(); helper.wait(); worker.join()
    """
)


def test_children_that_use_torch_get_an_agent_and_others_do_not(socket_dir: Path, tmp_path: Path):
    pytest.importorskip("torch")  # the child trains a torch model
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memtop.cli",
            "run",
            str(tmp_path / "parent.py"),
            str(tmp_path / "child.py"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
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
    assert parent.pid in agents  # `memtop run` itself
    assert pids["helper"] not in agents  # never imported torch
    assert pids["worker"] not in agents  # a spawned multiprocessing worker
    assert parent.wait(30) == 0


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
