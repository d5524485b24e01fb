"""Start-up hook for Python processes launched under `memtop run`.

`memtop run` puts this directory on PYTHONPATH and sets MEMTOP_AGENT=1, so the Python programs
the trainer launches (torchrun's ranks, say) get an agent too.  The agent starts only once the
program has imported torch, from a sleeping background thread, so a Python helper that never
touches torch pays nothing but that thread.  multiprocessing's spawned workers (DataLoader
workers) are skipped: they hold no model.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading


def _chain_to_the_next_sitecustomize() -> None:
    # Ours shadows any other sitecustomize on the path; run that one as Python would have.
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location(
                "_memtop_chained_sitecustomize", candidate
            )
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                except Exception as exc:
                    print(f"memtop: {candidate} failed: {exc}", file=sys.stderr)
            return


def _wait_for_torch_then_start() -> None:
    stop = threading.Event()
    while not stop.wait(0.5):
        if "torch.optim" in sys.modules and "torch.cuda" in sys.modules:
            # torch may still be importing on the main thread: start_agent's own `import
            # torch` waits on the module lock until that import is done.
            try:
                import memtop

                memtop.start_agent()
            except Exception as exc:  # never into the program
                print(f"memtop: agent not started: {exc}", file=sys.stderr)
            return


def _should_start() -> bool:
    if os.environ.get("MEMTOP_AGENT") != "1":
        return False
    return "--multiprocessing-fork" not in sys.argv


_chain_to_the_next_sitecustomize()
if _should_start():
    threading.Thread(
        target=_wait_for_torch_then_start, name="memtop-autostart", daemon=True
    ).start()
