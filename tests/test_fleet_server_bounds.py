"""The fleet view trusts its server for nothing (issue 27, finding 5): a real local HTTP server,
threads in the test, playing each hostile part: one that drips, one that sends too much, one
that nests deep, one that redirects elsewhere, one that never answers while `q` is pressed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memtop.sources import prometheus as prometheus_module
from memtop.sources.prometheus import PrometheusError, PrometheusSource

EMPTY = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()


class Server:
    """A TCP server on 127.0.0.1 that answers each connection with `behave(conn, request)` on
    a thread of its own, and remembers every request's head."""

    def __init__(self, behave: Callable[[socket.socket, bytes], None]) -> None:
        self.behave = behave
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            conn.settimeout(10)
            try:
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                self.requests.append(head)
                self.behave(conn, head)
            except OSError:
                pass

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, bytes], None]], Server]]:
    servers: list[Server] = []

    def start(behave: Callable[[socket.socket, bytes], None]) -> Server:
        servers.append(Server(behave))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def reply(conn: socket.socket, body: bytes, *, length: bool = True) -> None:
    head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if length:
        head += f"Content-Length: {len(body)}\r\n"
    conn.sendall(head.encode() + b"\r\n")
    conn.sendall(body)  # apart: no copy of a big body in this process, which tracemalloc sees


def drip(stop: threading.Event, every: float) -> Callable[[socket.socket, bytes], None]:
    """Headers, then one byte of a reply that never ends, every `every` seconds."""

    def behave(conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        while not stop.wait(every):
            conn.sendall(b" ")

    return behave


def memtop(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "memtop.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    return out, time.monotonic() - started


def test_a_dripping_server_meets_the_deadline(serve) -> None:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    server = serve(drip(stop, 0.3))  # well within the 5 s socket timeout: only a deadline ends it
    # The CLI as a script runs it (started first: it waits out its 10 s while the source below
    # waits out its own 1.5 s): one line, exit 1, within the default deadline.
    cli_started = time.monotonic()
    cli = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "--prometheus", server.url, "--once", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        started = time.monotonic()
        with pytest.raises(PrometheusError, match=r"did not answer within 1\.5 s"):
            PrometheusSource(server.url, deadline=1.5).read()
        assert time.monotonic() - started < 3.0
        _, stderr = cli.communicate(timeout=60)
        took = time.monotonic() - cli_started
        assert cli.returncode == 1 and stderr.count("\n") == 1, stderr
        assert "did not answer within 10 s" in stderr
        assert took < prometheus_module.READ_DEADLINE_S + 15
    finally:
        stop.set()
        if cli.poll() is None:
            cli.kill()
            cli.communicate()


def test_close_stops_a_read_in_progress(serve) -> None:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    server = serve(drip(stop, 0.3))
    source = PrometheusSource(server.url, deadline=60)
    errors: list[str] = []
    thread = threading.Thread(target=lambda: errors.append(_error_of(source.read)))
    try:
        thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        source.close()
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - started < 1.0
        assert errors == [f"Prometheus at {server.url}: reading stopped"]
    finally:
        stop.set()


def _error_of(call: Callable[[], object]) -> str:
    try:
        call()
    except PrometheusError as exc:
        return str(exc)
    return "no error"


def test_a_huge_reply_is_refused_with_bounded_memory(serve) -> None:  # type: ignore[no-untyped-def]
    item = b'{"metric":{},"value":[1,"1"]},'
    body = b'{"status":"success","data":{"resultType":"vector","result":['
    body += item * ((64 << 20) // len(item)) + b"{}]}}"  # 64 MiB, no Content-Length
    server = serve(lambda conn, head: reply(conn, body, length=False))
    tracemalloc.start()
    try:
        message = _error_of(lambda: PrometheusSource(server.url).query("up"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message == f"Prometheus at {server.url}: reply over 16 MiB"
    assert peak < 24 << 20, peak  # the cap and a chunk, never the 64 MiB
    said = serve(lambda conn, head: reply(conn, body[: 17 << 20]))  # with its Content-Length
    assert "reply of 17825792 bytes, over 16 MiB" in _error_of(
        lambda: PrometheusSource(said.url).query("up")
    )


def test_a_reply_of_millions_of_tiny_items_is_refused(serve) -> None:  # type: ignore[no-untyped-def]
    # 15 MiB of `{},`: within the byte cap, but 5 M dicts (0.5 GB) once parsed.
    body = b'{"status":"success","data":{"resultType":"vector","result":['
    body += b"{}," * (5 << 20) + b"{}]}}"
    server = serve(lambda conn, head: reply(conn, body))
    message = _error_of(lambda: PrometheusSource(server.url).query("up"))
    assert message == f"Prometheus at {server.url}: a reply of over 1,000,000 values"


def test_deep_nesting_is_one_line(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(lambda conn, head: reply(conn, b"[" * 200_000))
    out, _ = memtop("--prometheus", server.url, "--once")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr == (
        f"memtop: {server.url} did not answer as Prometheus does "
        "(its reply nests deeper than 64 levels)\n"
    )


def test_credentials_never_follow_a_redirect_to_another_origin(serve) -> None:  # type: ignore[no-untyped-def]
    elsewhere = serve(lambda conn, head: reply(conn, EMPTY))

    def redirect(target: str) -> Callable[[socket.socket, bytes], None]:
        def behave(conn: socket.socket, head: bytes) -> None:
            if b" /api/v1/query?" in head and b"moved=1" not in head:
                path = head.split(b" ")[1].decode()
                location = f"{target}{path}&moved=1"
                conn.sendall(
                    f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n"
                    "Connection: close\r\n\r\n".encode()
                )
            else:
                reply(conn, EMPTY)

        return behave

    away = serve(redirect(elsewhere.url))  # another port: another origin
    source = PrometheusSource(f"http://alice:s3cret@127.0.0.1:{away.port}")
    assert source.query("up") == []
    assert elsewhere.requests and len(away.requests) == 1
    assert b"authorization:" in away.requests[0].lower()
    assert all(b"authorization:" not in r.lower() for r in elsewhere.requests)

    home = serve(redirect(""))  # a relative redirect: the same origin keeps them
    home_source = PrometheusSource(f"http://alice:s3cret@127.0.0.1:{home.port}")
    assert home_source.query("up") == []
    assert len(home.requests) == 2
    assert all(b"authorization: basic" in r.lower() for r in home.requests)


def test_a_redirect_out_of_http_is_refused(serve) -> None:  # type: ignore[no-untyped-def]
    # urllib itself refuses file://, but follows ftp:// (with the headers it was given).
    def to_ftp(conn: socket.socket, head: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: ftp://127.0.0.1:9/x\r\nContent-Length: 0\r\n\r\n"
        )

    server = serve(to_ftp)
    message = _error_of(lambda: PrometheusSource(server.url).query("up"))
    assert message == (
        f"cannot reach Prometheus at {server.url}: redirected to 'ftp://127.0.0.1:9/x', not http(s)"
    )


@pytest.mark.slow
def test_q_quits_the_fleet_dashboard_while_a_read_hangs(  # type: ignore[no-untyped-def]
    serve, socket_dir: Path
) -> None:
    from test_ui_cli import drain, read_until, spawn_in_pty

    stop = threading.Event()
    server = serve(drip(stop, 0.3))
    process, master = spawn_in_pty(["--prometheus", server.url], socket_dir, size=(100, 30))
    try:
        read_until(master, b"fleet", timeout=30)  # the dashboard is up, the read still hangs
        assert len(server.requests) == 1 and process.poll() is None
        started = time.monotonic()
        os.write(master, b"q")
        assert drain(master, process) == 0
        assert time.monotonic() - started < 5.0
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
        os.close(master)
