"""`memtop run`: run a Python program in this process, like `python script.py` / `python -m`,
with the agent started first."""

from __future__ import annotations

import os
import runpy
import sys

from memtop.agent import start_agent


def run_program(target: str, args: list[str], as_module: bool) -> None:
    """Start the agent, then run `target` as __main__; SystemExit propagates as from python."""
    # Python programs this one launches (torchrun's ranks, say) start an agent too, once they
    # import torch: see memtop/agent/autostart/sitecustomize.py.
    os.environ["MEMTOP_AGENT"] = "1"
    autostart = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autostart")
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{autostart}{os.pathsep}{path}" if path else autostart
    # The program's own argv, so that `hello` (and the process table) names the program.
    sys.argv = [target, *args]
    start_agent(quiet=False)
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # Like `python script.py`: the script's directory comes first on sys.path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
