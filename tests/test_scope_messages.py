"""A filter that matches nothing says what it hid (issue 36, item 14): `--once --user nobody`
beside four agents said "No GPUs and no memtop agents found … try memtop demo", and
`memtop export --only 99` said nothing at all.  Real agents (tests/hostile_agent.py, kind
`honest`: a plain agent on one GPU) and the real command line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HOSTILE = str(Path(__file__).with_name("hostile_agent.py"))
AGENTS = 4


@pytest.fixture
def agents(socket_dir: Path) -> Iterator[list[int]]:
    processes = []
    try:
        for _ in range(AGENTS):
            process = subprocess.Popen(
                [sys.executable, HOSTILE, "honest", str(socket_dir)],
                stdout=subprocess.PIPE,
                text=True,
            )
            processes.append(process)
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield [p.pid for p in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()


def memtop(socket_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtop.cli", *args],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
    )  # fmt: skip


def test_once_says_what_a_filter_hid(agents: list[int], socket_dir: Path) -> None:
    text = memtop(socket_dir, "--once", "--user", "nobody").stdout
    assert "No GPUs and no memtop agents found" not in text and "memtop demo" not in text
    assert "start a trainer" not in text
    assert f"{AGENTS} agents filtered out by --user nobody" in text, text
    everyone = json.loads(memtop(socket_dir, "--once", "--json").stdout)
    assert sorted(a["pid"] for a in everyone["agents"]) == sorted(agents)
    assert everyone["filtered_out"] is None  # no filter, nothing hidden
    data = json.loads(memtop(socket_dir, "--once", "--json", "--user", "nobody").stdout)
    assert data["agents"] == [] and data["filtered_out"].startswith(f"{AGENTS} agents filtered")
    one = memtop(socket_dir, "--once", "--pid", str(agents[0])).stdout
    assert f"{AGENTS - 1} agents filtered out by --pid {agents[0]}" not in one  # shown: a row
    assert str(agents[0]) in one


def test_export_warns_of_a_gpu_that_is_not_there(socket_dir: Path) -> None:
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", "--only", "99", "--listen", "127.0.0.1:0"],
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert exporter.stdout is not None
        assert re.search(r"serving http://\S+/metrics", exporter.stdout.readline())
    finally:
        exporter.send_signal(signal.SIGTERM)
        _, err = exporter.communicate(timeout=15)
    warning = err.splitlines()[0] if err else ""
    assert warning.startswith("memtop export: warning: --only: no GPU 99 on this machine"), warning
