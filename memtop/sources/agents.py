"""What the memtop process reads from agents: discovery of sockets and one client per agent."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtop import protocol
from memtop.model import AgentHello, AgentSample


class AgentError(Exception):
    """An error frame from an agent (the command failed there; the connection is still fine)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message


class AgentUnreachable(Exception):
    """The agent cannot be reached or the connection broke; the message is one line."""


class AgentClient:
    """A blocking connection to one agent.  Used from the sampler thread or an action worker."""

    def __init__(self, pid: int, directory: Path | None = None, timeout: float = 2.0) -> None:
        self.pid = pid
        self.directory = directory
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._next_id = 1
        self.hello: AgentHello | None = None

    def connect(self) -> AgentHello:
        try:
            self._sock = protocol.connect(self.pid, self.directory, self.timeout)
        except OSError as exc:
            raise AgentUnreachable(protocol.describe_connect_error(self.pid, exc)) from None
        self.hello = protocol.parse_hello(self.request("hello"))
        return self.hello

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def request(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send one command and wait for its reply; returns `result` or raises AgentError."""
        if self._sock is None:
            raise AgentUnreachable(f"not connected to the agent of pid {self.pid}")
        request_id = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"id": request_id, "cmd": cmd}
        if args:
            message["args"] = args
        try:
            self._sock.settimeout(timeout or self.timeout)
            protocol.send_message(self._sock, message)
            while True:
                reply = protocol.recv_message(self._sock)
                if reply.get("id") == request_id or reply.get("id") is None:
                    break
        except (OSError, protocol.ConnectionClosed) as exc:
            self.close()
            reason = "timed out" if isinstance(exc, socket.timeout) else str(exc) or "closed"
            raise AgentUnreachable(f"agent of pid {self.pid}: {reason}") from None
        except protocol.ProtocolError as exc:
            self.close()
            raise AgentUnreachable(f"agent of pid {self.pid} sent a bad frame: {exc}") from None
        error = reply.get("error")
        if error is not None:
            if not isinstance(error, dict):
                error = {"code": "bad_reply", "message": str(error)}
            raise AgentError(str(error.get("code", "error")), str(error.get("message", "")))
        result = reply.get("result")
        if not isinstance(result, dict):
            raise AgentError("bad_reply", f"reply to {cmd!r} carries no result object")
        return result

    def sample(self) -> AgentSample:
        try:
            return protocol.parse_sample(self.request("sample"))
        except protocol.ProtocolError as exc:
            raise AgentError(exc.code, exc.message) from None

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# States of an agent as the viewer sees it.
CONNECTED = "connected"
EXITED = "exited"
UNREACHABLE = "unreachable"


@dataclass
class AgentPoll:
    """The outcome of polling one agent once."""

    pid: int
    state: str
    hello: AgentHello | None = None
    sample: AgentSample | None = None
    error: str | None = None


class AgentPool:
    """Finds agent sockets, keeps one connection to each, samples them all.

    An agent whose socket disappears is reported once as exited; one that cannot be reached
    is retried at a low rate, with the reason kept for the UI.
    """

    RETRY_S = 5.0

    def __init__(self, directory: Path | None = None, timeout: float = 1.0) -> None:
        self.directory = directory
        self.timeout = timeout
        # Why a socket directory was not read (owner, permissions), one line each, for the UI.
        self.problems: list[str] = []
        self._directory_of: dict[int, Path] = {}
        self._clients: dict[int, AgentClient] = {}
        self._failed_at: dict[int, tuple[float, str]] = {}
        self._hellos: dict[int, AgentHello] = {}

    def _scan(self) -> dict[int, Path]:
        directories = (
            [(self.directory, os.getuid())] if self.directory else protocol.discovery_dirs()
        )
        found: dict[int, Path] = {}
        problems = []
        for directory, owner in directories:
            try:
                protocol.check_socket_dir(directory, owner)
            except FileNotFoundError:
                continue
            except protocol.UnsafeSocketDir as exc:
                problems.append(f"ignoring agents: {exc}")
                continue
            for pid in protocol.list_agent_sockets(directory):
                found.setdefault(pid, directory)
        self.problems = problems
        return found

    def poll(self) -> list[AgentPoll]:
        found = self._scan()
        self._directory_of.update(found)
        results = []
        for pid in sorted(set(found) | set(self._clients) | set(self._failed_at)):
            if pid not in found:
                results.append(self._gone(pid))
                continue
            results.append(self._poll_one(pid, found[pid]))
        return results

    def directory_of(self, pid: int) -> Path | None:
        """Where the socket of `pid` was found (for actions on a fresh connection)."""
        return self._directory_of.get(pid, self.directory)

    def _gone(self, pid: int) -> AgentPoll:
        client = self._clients.pop(pid, None)
        if client is not None:
            client.close()
        self._failed_at.pop(pid, None)
        self._directory_of.pop(pid, None)
        return AgentPoll(pid, EXITED, self._hellos.pop(pid, None), error="process exited")

    def _poll_one(self, pid: int, directory: Path) -> AgentPoll:
        client = self._clients.get(pid)
        if client is None:
            failed = self._failed_at.get(pid)
            if failed is not None and time.monotonic() - failed[0] < self.RETRY_S:
                return AgentPoll(pid, UNREACHABLE, self._hellos.get(pid), error=failed[1])
            client = AgentClient(pid, directory, self.timeout)
            try:
                self._hellos[pid] = client.connect()
            except (AgentUnreachable, AgentError) as exc:
                client.close()
                self._failed_at[pid] = (time.monotonic(), str(exc))
                return AgentPoll(pid, UNREACHABLE, self._hellos.get(pid), error=str(exc))
            self._clients[pid] = client
            self._failed_at.pop(pid, None)
        try:
            sample = client.sample()
        except (AgentUnreachable, AgentError) as exc:
            client.close()
            self._clients.pop(pid, None)
            self._failed_at[pid] = (time.monotonic(), str(exc))
            state = EXITED if not protocol.pid_alive(pid) else UNREACHABLE
            return AgentPoll(pid, state, self._hellos.get(pid), error=str(exc))
        return AgentPoll(pid, CONNECTED, self._hellos.get(pid), sample=sample)

    def client(self, pid: int) -> AgentClient | None:
        return self._clients.get(pid)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
