"""Shared fixtures: short private socket directories (AF_UNIX paths are limited to 108 bytes),
and how the suite runs in parallel (pytest-xdist, `-n 4 --dist loadgroup`; see README)."""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the tests of a module that share a module- or session-scoped fixture (a
    trainer, a 20 s recording, a Prometheus) run in one worker: one fixture for them all, not
    one per worker that drew one of them (`--dist loadgroup`; without xdist the mark does
    nothing)."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None or item.get_closest_marker("xdist_group"):
            continue
        shared = any(
            definitions[-1].scope in ("module", "session")
            and definitions[-1].baseid.startswith(item.nodeid.split("::")[0])
            for definitions in fixtures.name2fixturedefs.values()
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
