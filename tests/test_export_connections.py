"""`memtop export` under a flood of slow connections (issue 27, finding 7): a thread per
connection, uncapped (717 slow connections made 718 threads), and no limit on the time to send
the headers.  Now: at most MAX_CONNECTIONS handlers (twice that while evicted ones finish), the
headers within HEADER_DEADLINE_S, and a scrape that sends its request at once is served."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop.export.server import HEADER_DEADLINE_S, MAX_CONNECTIONS

pytestmark = pytest.mark.slow

SLOW = 400


@pytest.fixture
def exporter(socket_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", "--listen", "127.0.0.1:0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stderr.read()
        yield proc, line.split()[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        return reply.read()


def test_slow_connections_get_bounded_threads_and_a_scrape_is_served(exporter) -> None:  # type: ignore[no-untyped-def]
    proc, url = exporter
    host, port = url.split("/")[2].split(":")
    idle = threads_of(proc.pid)
    slow: list[socket.socket] = []
    try:
        for _ in range(SLOW):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            slow.append(sock)
        time.sleep(0.5)  # the server has accepted them all
        assert threads_of(proc.pid) <= idle + 2 * MAX_CONNECTIONS, threads_of(proc.pid)
        started = time.monotonic()
        assert b"memtop_" in scrape(url)  # served through the flood
        assert time.monotonic() - started < 5.0
        assert threads_of(proc.pid) <= idle + 2 * MAX_CONNECTIONS
        # Past the header deadline every slow connection has been let go of.
        time.sleep(HEADER_DEADLINE_S + 1.0)
        for sock in slow:
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""
        assert threads_of(proc.pid) <= idle + 2
        assert b"memtop_" in scrape(url)
    finally:
        for sock in slow:
            sock.close()


def test_a_client_that_drips_its_headers_is_cut_at_the_deadline(exporter) -> None:  # type: ignore[no-untyped-def]
    # A byte every second keeps a per-read timeout (10 s) from ever firing.
    _, url = exporter
    host, port = url.split("/")[2].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    started = time.monotonic()
    try:
        request = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 30
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            sock.settimeout(1.0)
            try:
                if sock.recv(1024) == b"":
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
        took = time.monotonic() - started
    finally:
        sock.close()
    assert HEADER_DEADLINE_S - 1 < took < HEADER_DEADLINE_S + 3, took
