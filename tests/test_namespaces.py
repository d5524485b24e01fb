"""Agent sockets of other pid namespaces, as the viewer reads them (issue 25.1), without root:
the names, and a socket whose name claims a process of another namespace but is served by
someone else (or by no one)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from memtop.protocol import namespaces
from memtop.sources.agents import AgentPool

OTHER_NAMESPACE = 4026532999  # not ours, not the host's


def test_socket_names() -> None:
    assert namespaces.parse_socket_name("12.sock") == (12, None)
    assert namespaces.parse_socket_name(f"1.ns{OTHER_NAMESPACE}.sock") == (1, OTHER_NAMESPACE)
    # The host's agents never use the long form; digits only, ASCII only.
    for name in (
        "1.ns4026531836.sock",
        "١.sock",
        "1.nsx.sock",
        "1.ns.sock",
        "1.ns1.sockx",
        "x.sock",
    ):
        assert namespaces.parse_socket_name(name) is None, name
    assert namespaces.socket_name(7, None) == "7.sock"
    assert namespaces.socket_name(7, namespaces.INIT_PID_NAMESPACE) == "7.sock"
    assert namespaces.socket_name(7, OTHER_NAMESPACE) == f"7.ns{OTHER_NAMESPACE}.sock"
    me = os.getpid()
    assert namespaces.expected_socket_name(me) == namespaces.own_socket_name()
    assert namespaces.innermost_pid(me) == me
    assert namespaces.foreign_socket_name(me) is None  # our own namespace: the plain name


def test_a_name_claiming_another_namespace_is_refused_and_not_asked_again(
    socket_dir: Path,
) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_dir / f"1.ns{OTHER_NAMESPACE}.sock"))
    listener.listen(8)
    listener.setblocking(False)
    pool = AgentPool(socket_dir, timeout=1.0)
    try:
        assert pool.poll() == []
        assert any(
            f"is served by pid {os.getpid()}, not the process it names" in p for p in pool.problems
        ), pool.problems
        knocks = 0
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            conn.close()
            knocks += 1
        assert knocks == 1  # connected once, sent nothing
        pool._last_scan = None  # a full scan again: the refusal is remembered, no new knock
        assert pool.poll() == []
        assert any("not the process it names" in p for p in pool.problems)
        try:
            listener.accept()
            raise AssertionError("asked again")
        except BlockingIOError:
            pass
    finally:
        pool.close()
        listener.close()


def test_a_stale_socket_of_another_namespace_is_removed(socket_dir: Path) -> None:
    path = socket_dir / f"5.ns{OTHER_NAMESPACE}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.close()  # bound, never listening: what a dead agent leaves behind
    pool = AgentPool(socket_dir, timeout=1.0)
    try:
        assert pool.poll() == []
        assert not path.exists()
    finally:
        pool.close()
