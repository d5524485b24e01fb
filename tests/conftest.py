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


# The modules that take 15 s or more in one process (measured on the 2-core box, issue 22.6),
# longest first.  In workers a module is one unit of work, handed out in collection order, and
# a 30 s module handed out last runs alone while the other workers sit idle (alphabetically the
# soak and the stability tests came near the end).  A stale entry only costs some idle time.
LONG_MODULES = (
    "tests/test_soak.py",
    "tests/test_suggestion_stability.py",
    "tests/test_attach.py",
    "tests/test_agent_limits.py",
    "tests/test_record.py",
    "tests/test_prometheus.py",
    "tests/test_diagnosis_scenarios.py",
    "tests/test_replay_screen.py",
    "tests/test_hostile_agents.py",
    "tests/test_ui_live.py",
    "tests/test_fleet_server_bounds.py",
    "tests/test_export_connections.py",
    "tests/test_sites.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long modules first, the rest in their usual order (a stable sort)."""
    rank = {module: i for i, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
