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

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The suite's torch trainers are tiny CPU models.  torch's intra-op threads (one per core) spin
# after each parallel region, and a trainer that sleeps between steps burned a second core for
# nothing: `memtop run examples/train_cpu.py` for 300 steps cost 4.9 CPU-s with them, 3.0 with
# one thread.  Four workers share the CI box's 2 cores; every torch process the suite starts
# (and the workers' own) inherits this unless the caller set it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="mt-"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _private_socket_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No test may see (or clean up) the sockets of real trainers on this machine.
    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(tmp_path / "no-agents-here"))
