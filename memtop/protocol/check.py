"""Does an agent speak memtop?  A conformance check any implementation can run against itself.

    python -m memtop.protocol.check PID [--socket-dir DIR] [--json]

It connects to `<socket dir>/<PID>.sock` as memtop would (same checks: no symlink, the server's
SO_PEERCRED pid and uid) and holds the agent to the wire schema of DESIGN §6: every reply parsed
by `memtop.protocol` (the same parsers the viewer uses), ids echoed, errors as error frames with
the protocol's codes, a malformed frame answered and the connection closed, the stats keys memtop
reads all present, numbers that can be true together.  It sends every command of the table
(memtop.protocol.commands) that changes nothing in the trainer (`hello`, `sample`, `breakdown`,
`snapshot` without a file, `sites` without switching stacks) and never one that does
(`cleanup`, `reset_peak`): their reply parsers are exercised by memtop's own tests.

Exit status 0 when every check passes, 1 when one fails, 2 when the agent cannot be reached.
A JAX agent or a test double runs this to prove it can stand in for memtop's own.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtop import protocol
from memtop.protocol import commands

TIMEOUT_S = 10.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


class _Conversation:
    """One connection to the agent, raw frames: the check must see exactly what was sent."""

    def __init__(self, pid: int, directory: Path) -> None:
        self.pid = pid
        self.path = protocol.socket_path(pid, directory)
        self.sock = protocol.connect(pid, directory, timeout=TIMEOUT_S)
        self.next_id = 1000

    def ask(self, cmd: str, args: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        self.next_id += 1
        request: dict[str, Any] = {"id": self.next_id, "cmd": cmd}
        if args is not None:
            request["args"] = args
        protocol.send_message(self.sock, request)
        return self.next_id, protocol.recv_message(self.sock)

    def close(self) -> None:
        self.sock.close()


def run_checks(pid: int, directory: Path) -> list[Check]:
    """Every check, in order; a failure does not stop the ones that do not depend on it."""
    checks: list[Check] = []

    def check(name: str, body: Callable[[], str | None]) -> bool:
        try:
            detail = body() or ""
            checks.append(Check(name, True, detail))
            return True
        except AssertionError as exc:
            checks.append(Check(name, False, str(exc) or "failed"))
        except protocol.ProtocolError as exc:
            checks.append(Check(name, False, f"{exc.code}: {exc.message}"))
        except (OSError, protocol.ConnectionClosed) as exc:
            checks.append(Check(name, False, f"connection: {exc}"))
        return False

    talk = _Conversation(pid, directory)
    state: dict[str, Any] = {}
    try:

        def peer() -> str:
            peer_pid, peer_uid, _ = protocol.peer_credentials(talk.sock)
            assert peer_pid == pid, f"the socket is served by pid {peer_pid}, not {pid}"
            return f"served by pid {peer_pid}, uid {peer_uid}"

        def hello() -> str:
            rid, reply = talk.ask("hello")
            assert reply.get("id") == rid, f"reply id {reply.get('id')!r}, request id {rid}"
            assert "result" in reply, f"hello answered with an error: {reply.get('error')}"
            parsed = protocol.parse_hello(reply["result"])
            assert parsed.protocol == protocol.PROTOCOL_VERSION, (
                f"protocol {parsed.protocol}, memtop speaks {protocol.PROTOCOL_VERSION}"
            )
            assert parsed.pid == pid, f"hello says pid {parsed.pid}, the socket is {pid}'s"
            indices = [d.index for d in parsed.devices]
            assert len(set(indices)) == len(indices), "device indices repeat"
            state["hello"] = parsed
            return f"protocol {parsed.protocol}, {len(parsed.devices)} device(s)"

        def sample() -> str:
            rid, reply = talk.ask("sample")
            assert reply.get("id") == rid, f"reply id {reply.get('id')!r}, request id {rid}"
            assert "result" in reply, f"sample answered with an error: {reply.get('error')}"
            parsed = protocol.parse_sample(reply["result"])
            hello = state.get("hello")
            known = {d.index: d for d in hello.devices} if hello else {}
            problems = []
            for dev in parsed.devices:
                if known and dev.index not in known:
                    problems.append(f"sample has device {dev.index}, hello does not")
                stats = dev.stats
                allocated = stats.get("allocated_bytes.all.current", 0)
                reserved = stats.get("reserved_bytes.all.current", 0)
                if allocated > reserved:
                    problems.append(
                        f"device {dev.index}: allocated {allocated} > reserved {reserved}"
                    )
                if stats.get("allocated_bytes.all.peak", allocated) < allocated:
                    problems.append(f"device {dev.index}: peak below current allocated")
                if reserved > dev.total_bytes or dev.free_bytes > dev.total_bytes:
                    problems.append(f"device {dev.index}: reserved or free above the total")
                missing = [k for k in protocol.SAMPLE_STAT_KEYS if k not in stats]
                if missing:
                    problems.append(f"device {dev.index} lacks stats {missing[:4]}")
            # Floor readings (optional; docs/protocol.md): both fields or neither, the lowest of
            # the reads since the previous sample, this sample's own included.
            for raw in reply["result"].get("devices") or []:
                has = [k in raw for k in ("allocated_floor_bytes", "floor_readings")]
                if any(has) and not all(has):
                    problems.append(
                        f"device {raw.get('index')}: allocated_floor_bytes and floor_readings"
                        " come together"
                    )
            for dev in parsed.devices:
                if dev.allocated_floor is not None and dev.allocated_floor > dev.allocated:
                    problems.append(
                        f"device {dev.index}: allocated_floor_bytes {dev.allocated_floor} above"
                        f" allocated {dev.allocated}"
                    )
            # Host memory (optional): the kernel's figures, which hold together at one read.
            host = parsed.host_memory
            if host is not None:
                if host.rss_bytes > host.peak_rss_bytes:
                    problems.append("host_memory: rss_bytes above its peak_rss_bytes")
                if host.total_bytes is not None and host.peak_rss_bytes > host.total_bytes:
                    problems.append("host_memory: peak_rss_bytes above total_bytes")
            for mark in parsed.step_marks:
                if mark.host_heap_free is not None and mark.host_rss is None:
                    problems.append(f"step mark {mark.step}: heap free bytes without host_rss")
                    break
            # The optional action log (DESIGN §13): the viewer leaves out an entry of the wrong
            # shape; an agent that sends one fails here.  Numbered in order, oldest first.
            raw_actions = reply["result"].get("actions") or []
            if len(parsed.actions) != len(raw_actions):
                problems.append(
                    f"actions: {len(raw_actions) - len(parsed.actions)} entry(ies) malformed"
                )
            seqs = [a.seq or 0 for a in parsed.actions]
            if seqs != sorted(set(seqs)):
                problems.append("actions: entries not in the order of their seq")
            assert not problems, "; ".join(problems)
            described = "" if host is None else ", host memory"
            if parsed.actions:
                described += f", {len(parsed.actions)} action(s) logged"
            return (
                f"{len(parsed.devices)} device(s), {len(parsed.step_marks)} step mark(s)"
                + described
            )

        def sample_options() -> str:
            # DESIGN §6: an agent honours max_marks and mark_layout, or (older) ignores them;
            # either way the reply must parse, and an honoured limit must hold.
            rid, reply = talk.ask("sample", {"max_marks": 1, "mark_layout": "columns"})
            assert reply.get("id") == rid, f"reply id {reply.get('id')!r}, request id {rid}"
            assert "result" in reply, f"sample with options got an error: {reply.get('error')}"
            result = reply["result"]
            parsed = protocol.parse_sample(result)
            if "step_mark_columns" not in result:
                return f"options ignored (rows, {len(parsed.step_marks)} mark(s))"
            assert len(parsed.step_marks) <= 1, (
                f"max_marks 1 answered with {len(parsed.step_marks)} marks"
            )
            return f"columns, {len(parsed.step_marks)} mark(s)"

        def low_rate(cmd: str) -> Callable[[], str]:
            def body() -> str:
                rid, reply = talk.ask(cmd)
                assert reply.get("id") == rid, f"reply id {reply.get('id')!r}, request id {rid}"
                if "error" in reply:
                    # Allowed: an agent may lack a figure (no steps yet, no such command).
                    error = reply["error"]
                    assert isinstance(error, dict) and isinstance(error.get("code"), str), (
                        "error is not {code, message}"
                    )
                    return f"declined: {error['code']}"
                parsed = protocol.parse_reply(cmd, reply["result"])
                if cmd == "sites":
                    state_of = "on" if parsed.enabled else "off"
                    return f"stacks {state_of}, {len(parsed.sites)} site(s)"
                return "pending" if parsed.pending else f"{len(parsed.devices)} device(s)"

            return body

        def sites_history() -> str:
            # DESIGN §13: a first `sites` may ask the kept rounds; an older agent ignores it.
            rid, reply = talk.ask("sites", {"history": True})
            assert reply.get("id") == rid, f"reply id {reply.get('id')!r}, request id {rid}"
            if "error" in reply:
                error = reply["error"]
                assert isinstance(error, dict) and isinstance(error.get("code"), str), (
                    "error is not {code, message}"
                )
                return f"declined: {error['code']}"
            parsed = protocol.parse_sites(reply["result"])
            if "history" not in reply["result"]:
                return "none kept (an agent that predates it)"
            times = [r.time or 0.0 for r in parsed.history]
            assert times == sorted(times), "history rounds not oldest first"
            assert parsed.time is None or all(t < parsed.time for t in times), (
                "a history round not older than the newest"
            )
            return f"{len(parsed.history)} past round(s)"

        def unknown_command() -> str:
            rid, reply = talk.ask("rm -rf /")
            assert reply.get("id") == rid, "an error reply must echo the request's id"
            code = (reply.get("error") or {}).get("code")
            assert code in (protocol.E_UNKNOWN_COMMAND, protocol.E_BAD_REQUEST), (
                f"an unknown command got {reply!r:.200}"
            )
            # ... and the connection stays usable.
            rid, again = talk.ask("hello")
            assert again.get("id") == rid and "result" in again, "no answer after the error"
            return code

        def bad_arguments() -> str:
            rid, reply = talk.ask("snapshot", {"path": 42})
            code = (reply.get("error") or {}).get("code")
            assert reply.get("id") == rid and code == protocol.E_BAD_REQUEST, (
                f"snapshot with a numeric path got {reply!r:.200}"
            )
            return code

        def malformed_frame() -> str:
            raw = protocol.connect(pid, directory, timeout=TIMEOUT_S)
            try:
                raw.sendall(struct.pack(">I", 9) + b"not json!")
                reply = protocol.recv_message(raw)
                code = (reply.get("error") or {}).get("code")
                assert code == protocol.E_BAD_FRAME, f"a malformed frame got {reply!r:.200}"
                try:
                    protocol.recv_message(raw)
                except (protocol.ConnectionClosed, OSError):
                    return "error frame, then closed"
                raise AssertionError("the connection stayed open after a malformed frame")
            finally:
                raw.close()

        def still_serving() -> str:
            rid, reply = talk.ask("sample")
            assert reply.get("id") == rid and "result" in reply, "no sample after the checks"
            protocol.parse_sample(reply["result"])
            return "yes"

        check("peer credentials", peer)
        if check("hello", hello):
            check("sample", sample)
            check("sample options", sample_options)
        # Every other command of the table that changes nothing in the trainer when asked
        # without arguments (memtop.protocol.commands).
        for command in commands.COMMANDS:
            if command.asked not in (commands.ON_CONNECT, commands.EVERY_ROUND) and (
                not command.acts()
            ):
                check(command.name, low_rate(command.name))
        check("sites history", sites_history)
        check("unknown command", unknown_command)
        check("bad arguments", bad_arguments)
        check("malformed frame", malformed_frame)
        check("serves after all of it", still_serving)
    finally:
        talk.close()
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m memtop.protocol.check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("pid", type=int)
    parser.add_argument("--socket-dir", type=Path, help="default: this user's socket directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    directory = args.socket_dir or protocol.socket_dir()
    try:
        protocol.check_socket_entry(protocol.socket_path(args.pid, directory), os.geteuid())
        checks = run_checks(args.pid, directory)
    except (TimeoutError, OSError, protocol.ProtocolError, protocol.PeerRefused) as exc:
        print(f"memtop: cannot reach the agent of pid {args.pid}: {exc}", file=sys.stderr)
        return 2
    failed = [c for c in checks if not c.ok]
    if args.json:
        print(
            json.dumps({"pid": args.pid, "passed": not failed, "checks": [vars(c) for c in checks]})
        )
    else:
        for c in checks:
            print(
                f"{'PASS' if c.ok else 'FAIL'}  {c.name:<24} {protocol.clean_text(c.detail, 200)}"
            )
        print(f"{len(checks) - len(failed)} of {len(checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
