"""Unit tests of the viewer's defences (issue 10): depth and size limits, inert text, schema
bounds, sanity of numbers, server authentication on a socketpair-free real listener."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from memtop import protocol
from memtop.model import AgentDevice, AgentDeviceSample, AgentHello, AgentSample
from memtop.sources.agents import AgentClient, AgentRefused, AgentTimeout, sanity_problem


@pytest.mark.parametrize("depth", [65, 1000, 200_000])
def test_deep_json_is_a_protocol_error_not_a_recursion_error(depth: int) -> None:
    body = b'{"id":1,"result":' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(protocol.ProtocolError, match="deeper than 64"):
        protocol.decode_body(body)


def test_depth_limit_counts_only_real_nesting() -> None:
    ok = json.dumps({"a": [[[1]]] * 5000, "s": "[" * 5000, "t": '\\"[[[[' * 100}).encode()
    assert len(protocol.decode_body(ok)["a"]) == 5000
    at_limit = ("[" * 63 + "]" * 63).encode()
    assert protocol.decode_body(b'{"a":' + at_limit + b"}")
    # Unbalanced garbage is still refused as a protocol error, whatever json thinks of it.
    for body in (b"[" * 100_000, b'{"a":' + b"[" * 3000 + b"]"):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode_body(body)


@pytest.mark.parametrize(
    "body", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": ' + b"9" * 5000 + b"}", b"\xff\xfe"]
)
def test_non_json_numbers_and_bytes_are_protocol_errors(body: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_body(body)


def test_clean_text_leaves_nothing_a_terminal_acts_on() -> None:
    nasty = "a\x1b]0;title\x07b\x1b[2J\x9b31m\u202eevil\x00\x7f\ttab\nline"
    clean = protocol.clean_text(nasty)
    assert all(ch.isprintable() for ch in clean), repr(clean)
    assert "title" in clean and "evil" in clean
    assert len(protocol.clean_text("x" * 10_000)) == protocol.MAX_TEXT


def hello(**overrides: object) -> dict[str, object]:
    result: dict[str, object] = {
        "protocol": 1,
        "pid": 7,
        "argv": ["train.py", "\x1b]52;c;AAAA\x07"],
        "python": "3.11\x1b[2J",
        "torch": None,
        "allocator_conf": "",
        "devices": [{"index": 0, "uuid": "GPU-1", "name": "H\x1b[31m100", "total_bytes": 80}],
        "extra\x1b": {"nested": ["\x1b[2J"]},
    }
    result.update(overrides)
    return result


def test_parse_hello_cleans_every_string() -> None:
    parsed = protocol.parse_hello(hello())
    texts = [*parsed.argv, parsed.python, parsed.devices[0].name, *map(str, parsed.extra.items())]
    assert not any("\x1b" in t or "\x07" in t for t in texts), texts


@pytest.mark.parametrize(
    "overrides",
    [
        {"argv": ["x"] * 1000},
        {"devices": [{"index": 0, "uuid": "u", "name": "n", "total_bytes": -1}]},
        {"devices": [{"index": i, "uuid": "u", "name": "n", "total_bytes": 1} for i in range(99)]},
    ],
)
def test_parse_hello_bounds(overrides: dict[str, object]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_hello(hello(**overrides))


def test_parse_sample_refuses_negative_sizes_and_non_finite_times() -> None:
    device = {"index": 0, "stats": {}, "free_bytes": -5, "total_bytes": 10}
    with pytest.raises(protocol.ProtocolError, match="negative"):
        protocol.parse_sample({"time": 1.0, "step": 1, "devices": [device]})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sample({"time": 1e400, "step": 1, "devices": []})


def sample(
    allocated: int, reserved: int, total: int = 100, ooms: int = 0, step: int = 1
) -> AgentSample:
    stats = {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "num_ooms": ooms,
    }
    return AgentSample(1.0, step, (AgentDeviceSample(0, stats, total - reserved, total),))


HELLO = AgentHello(1, 7, ("t",), "3", None, "", (AgentDevice(0, "GPU-1", "g", 100),))


def test_sanity_rules() -> None:
    assert sanity_problem(HELLO, sample(10, 20), {"GPU-1": 100}, {}) is None
    assert "> reserved" in (sanity_problem(HELLO, sample(30, 20), None, {}) or "")
    assert "exceeds total" in (sanity_problem(HELLO, sample(10, 200, total=100), None, {}) or "")
    assert "unknown to the driver" in (
        sanity_problem(HELLO, sample(1, 2), {"GPU-2": 100}, {}) or ""
    )
    assert "claims" in (sanity_problem(HELLO, sample(1, 2, total=1000), {"GPU-1": 100}, {}) or "")
    counters: dict[str, int] = {}
    assert sanity_problem(HELLO, sample(1, 2, ooms=5, step=10), None, counters) is None
    assert "num_ooms went backwards" in (
        sanity_problem(HELLO, sample(1, 2, ooms=2, step=11), None, counters) or ""
    )
    assert "step went backwards" in (
        sanity_problem(HELLO, sample(1, 2, ooms=2, step=3), None, counters) or ""
    )


def serve(path: Path, handler) -> tuple[socket.socket, threading.Thread]:  # type: ignore[no-untyped-def]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)

    def run() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            handler(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def test_client_refuses_a_server_with_another_pid_before_sending(socket_dir: Path) -> None:
    received: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        conn.settimeout(1)
        with contextlib.suppress(OSError):
            received.append(conn.recv(100))

    # This process serves a socket named after pid 1 (init, also ours when run as root).
    listener, thread = serve(socket_dir / "1.sock", handler)
    try:
        with pytest.raises(AgentRefused):
            AgentClient(1, socket_dir, timeout=1, owner=os.stat("/proc/1").st_uid).connect()
        thread.join(2)
        assert received in ([], [b""])  # nothing was sent
    finally:
        listener.close()


def test_client_refuses_a_symlinked_socket(socket_dir: Path, tmp_path: Path) -> None:
    listener, _ = serve(tmp_path / "real.sock", lambda conn: None)
    try:
        os.symlink(tmp_path / "real.sock", socket_dir / f"{os.getpid()}.sock")
        with pytest.raises(AgentRefused, match="symlink"):
            AgentClient(os.getpid(), socket_dir, timeout=1).connect()
    finally:
        listener.close()


def test_a_trickling_server_cannot_extend_the_deadline(socket_dir: Path) -> None:
    import time

    def handler(conn: socket.socket) -> None:
        conn.recv(1000)
        reply = json.dumps({"id": 1, "result": {"x": "y" * 200}}).encode()
        frame = len(reply).to_bytes(4, "big") + reply
        for byte in frame:  # a byte every 50 ms: 10+ s in all
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.05)

    listener, _ = serve(socket_dir / f"{os.getpid()}.sock", handler)
    try:
        client = AgentClient(os.getpid(), socket_dir, timeout=0.5)
        started = time.monotonic()
        with pytest.raises(AgentTimeout):
            client.connect()
        assert time.monotonic() - started < 1.0
    finally:
        listener.close()


def test_the_socket_scan_is_reused_only_while_nothing_it_checked_can_have_changed(
    socket_dir: Path,
) -> None:
    """Between full scans a round reuses the last one if the directory has the same entries
    and every agent's process exists; a new socket, a process gone, a directory made unsafe
    are seen at once, and a zombie at the next full scan."""
    import subprocess
    import sys
    import time

    from memtop.sources.agents import AgentPool

    children: list[subprocess.Popen[bytes]] = []
    listeners: list[socket.socket] = []

    def trainer() -> int:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        children.append(child)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(socket_dir / f"{child.pid}.sock"))
        listeners.append(listener)
        return child.pid

    pool = AgentPool(socket_dir)
    pool.FULL_SCAN_S = 60.0  # only what changed may bring a full scan in this test
    try:
        first = trainer()
        assert set(pool._scan().found) == {first}
        again = pool._scan()
        assert again is pool._last_scan[2]  # type: ignore[index]  # reused: nothing changed
        second = trainer()
        assert set(pool._scan().found) == {first, second}  # a new socket: seen at once
        children[0].kill()
        children[0].wait()
        assert set(pool._scan().found) == {second}  # a process gone: seen at once
        assert not (socket_dir / f"{first}.sock").exists()  # and its socket removed
        pool._scan()  # (that removal changed the directory: one more full scan settles it)
        children[1].kill()  # a zombie until reaped: it exists, so the scan is reused ...
        time.sleep(0.2)
        assert set(pool._scan().found) == {second}
        pool.FULL_SCAN_S = 0.0  # ... until the next full scan, which sees what it is
        assert set(pool._scan().found) == set()
        pool.FULL_SCAN_S = 60.0
        socket_dir.chmod(0o777)  # made unsafe: refused at once, whatever the last scan said
        assert pool._scan().found == {} and "writable" in " ".join(pool.problems)
    finally:
        socket_dir.chmod(0o700)
        for listener in listeners:
            listener.close()
        for child in children:
            child.kill()
            child.wait()


@pytest.mark.parametrize("name", ["².sock", "٣.sock", "١٢.sock", "sim-²", "sim-٣"])
def test_names_with_other_digits_neither_stop_nor_pass_the_scan(
    socket_dir: Path, name: str
) -> None:
    # str.isdigit takes "²" (int() refuses it: the scan stopped) and Arabic-Indic digits
    # (int() reads them: "٣.sock" stood for pid 3). Anyone can make /tmp/memtop-² for root.
    from memtop.sim.demo import live_registries
    from memtop.sources.agents import AgentPool

    (socket_dir / name).mkdir()
    assert protocol.socket_pid(name) is None
    assert protocol.decimal(name.removesuffix(".sock").removeprefix("sim-")) is None
    assert protocol.list_agent_sockets(socket_dir) == []
    assert live_registries(socket_dir) == []
    pool = AgentPool(socket_dir)
    try:
        assert not pool.poll() and pool.problems == []
    finally:
        pool.close()
    assert (protocol.socket_pid("123.sock"), protocol.decimal("0042")) == (123, 42)


def test_digits_from_the_environment_and_the_command_line_are_ascii(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memtop.agent.server import _env_int
    from memtop.export.server import ExportError, parse_listen

    monkeypatch.setenv("RANK", "²")
    assert _env_int("RANK") is None  # it raised into the trainer as its agent started
    monkeypatch.setenv("RANK", " 3 ")
    assert _env_int("RANK") == 3
    with pytest.raises(ExportError):
        parse_listen(":²")
    assert parse_listen(":9400") == ("127.0.0.1", 9400)
