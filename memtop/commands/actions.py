"""`memtop cleanup PID` and `memtop snapshot PID -o FILE`: one agent command from the command
line, asked through the dashboard's own path (memtop.engine.sampler.ask_agent) with the agent
located
as root must locate it."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path
from typing import Any

from memtop.base.errors import MemtopError
from memtop.commands import EXIT_OK


def run(args: argparse.Namespace) -> int:
    return _cleanup(args) if args.command == "cleanup" else _snapshot(args)


def _agent_location(pid: int, socket_dir: Path | None) -> tuple[Path, int]:
    """The socket directory of `pid` and the uid that must own it: ours, or as root the
    directory of the user who runs `pid` (never another user's socket for that pid; whose the
    directory is, is checked when connecting)."""
    from memtop import protocol
    from memtop.protocol import namespaces
    from memtop.protocol.discovery import canonical_dirs

    if socket_dir is not None or os.environ.get("MEMTOP_SOCKET_DIR"):
        return socket_dir or protocol.socket_dir(), os.getuid()
    process_owner = protocol.pid_owner(pid)
    if os.geteuid() != 0:
        if process_owner is not None and process_owner != os.getuid():
            # Its agent (if any) is in its owner's socket directory, which is 0700: saying "no
            # agent socket" would send the user to attach one that is already there.
            raise MemtopError(
                f"pid {pid} belongs to another user ({protocol.user_name(process_owner)}): its "
                "agent, if it has one, listens in that user's socket directory, which you cannot "
                "reach; run this command as root (sudo memtop …)"
                + ("" if process_owner == 0 else " or as that user")
            )
        return protocol.socket_dir(), os.getuid()
    if process_owner is None:
        raise MemtopError(f"no process {pid}")
    name = namespaces.foreign_socket_name(pid)
    own = [protocol.socket_dir()] if process_owner == os.getuid() else []
    for directory in [*own, *canonical_dirs(process_owner)]:
        path = directory / name if name else protocol.socket_path(pid, directory)
        if os.path.lexists(path):
            return directory, process_owner
    raise MemtopError(
        f"no agent socket for pid {pid} in the socket directory of its owner (uid "
        f"{process_owner}): start it under `memtop run`, or add an agent with "
        f"`memtop attach {pid}`"
    )


def agent_action(
    pid: int, cmd: str, cmd_args: dict[str, object], socket_dir: Path | None
) -> dict[str, Any]:
    """The agent of `pid` runs `cmd`: its reply (schema-checked), or a MemtopError in one line."""
    from memtop.engine.sampler import AgentAddress, MalformedReply, ask_agent
    from memtop.protocol import namespaces
    from memtop.sources.agents import AgentError, AgentUnreachable

    directory, owner = _agent_location(pid, socket_dir)
    # A process in a container: its agent's socket carries its own pid and namespace.
    where = AgentAddress(directory, owner, namespaces.foreign_socket_name(pid))
    # The agent answers within its wait for a step boundary; give the reply time to come.
    wait = cmd_args.get("wait_s", 0.0)
    timeout = 15.0 + (float(wait) if isinstance(wait, int | float) else 0.0)
    try:
        # The same checks as the dashboard: lstat, no symlink, SO_PEERCRED pid and uid, hello.
        return ask_agent(pid, cmd, dict(cmd_args) or None, where, timeout, connect_timeout=5.0)
    except MalformedReply as exc:
        raise MemtopError(exc.message) from None
    except (AgentUnreachable, AgentError) as exc:
        raise MemtopError(str(exc)) from None


def _cleanup(args: argparse.Namespace) -> int:
    from memtop.figures.units import format_bytes

    if args.wait < 0:
        raise MemtopError("--wait must be seconds >= 0")
    result = agent_action(args.pid, "cleanup", {"wait_s": args.wait}, args.socket_dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    from memtop.protocol import parse_cleanup

    cleanup = parse_cleanup(result)
    if cleanup.after_step is not None:
        print(
            f"pid {args.pid}: ran on the trainer's thread after step {cleanup.after_step}, "
            f"before the next one ({(cleanup.took_s or 0) * 1000:.0f} ms)"
        )
    if not cleanup.released_bytes:
        print(f"pid {args.pid}: no CUDA device in use: nothing to clean up")
    for index, n in sorted(cleanup.released_bytes.items()):
        after = cleanup.reserved_after.get(index)
        print(
            f"pid {args.pid} GPU {index}: released {format_bytes(n)} "
            f"(reserved now {format_bytes(after)})"
        )
    return EXIT_OK


def _snapshot(args: argparse.Namespace) -> int:
    from memtop.figures.units import format_bytes
    from memtop.model import snapshot_note

    if args.wait < 0:
        raise MemtopError("--wait must be seconds >= 0")
    path = snapshot_output(args.output, args.pid, args.force)
    request: dict[str, object] = {"path": str(path), "wait_s": args.wait}
    if args.force:
        request["overwrite"] = True
    result = agent_action(args.pid, "snapshot", request, args.socket_dir)
    # Believe the file system, not the agent: say "wrote" only for a file that is there.
    written = os.path.lexists(path) and os.path.isfile(path) and not os.path.islink(path)
    if not written:
        raise MemtopError(
            f"the agent of pid {args.pid} answered, but no snapshot file is at {path}"
        )
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    from memtop.protocol import parse_snapshot

    devices = parse_snapshot(result).devices
    print(f"wrote {path}  ({snapshot_note(devices)})")
    for index, dev in sorted(devices.items()):
        print(
            f"GPU {index}: {dev.get('segments', 0):.0f} segments, "
            f"reserved {format_bytes(int(dev.get('reserved_bytes', 0)))}, "
            f"allocated {format_bytes(int(dev.get('allocated_bytes', 0)))}, "
            f"external fragmentation {dev.get('external_fragmentation', 0.0):.2f}"
        )
    return EXIT_OK


def snapshot_output(output: Path, pid: int, force: bool) -> Path:
    """The path the agent will write: made absolute by joining the current directory, never
    resolved.  A link resolved here was followed past the agent's checks (its lstat, O_EXCL and
    O_NOFOLLOW apply to the path it is given): another user's /tmp/snap.pickle -> a third user's
    authorized_keys was overwritten with --force, and a dangling link made the trainer create
    the file it named.  What the agent would refuse is refused here at once, in one line."""
    path = output if output.is_absolute() else Path.cwd() / output
    try:
        info: os.stat_result | None = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    except OSError as exc:
        raise MemtopError(f"cannot inspect {path}: {exc.strerror}") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise MemtopError(
                f"{path} is a symbolic link: memtop never writes through one, with --force or "
                "without; give the path of the file itself"
            )
        if stat.S_ISDIR(info.st_mode):
            raise MemtopError(
                f"{path} is a directory: give a file name in it "
                f"(-o {path / f'snapshot-{pid}.pickle'})"
            )
        if not stat.S_ISREG(info.st_mode):
            raise MemtopError(f"{path} exists and is not a regular file")
        if not force:
            raise MemtopError(f"{path} exists; add --force to overwrite it")
    # A link in a directory above, owned by someone else, leads the write where they chose.
    for folder in reversed(path.parents):
        try:
            above = os.lstat(folder)
        except OSError:
            break  # missing: said below
        if stat.S_ISLNK(above.st_mode) and above.st_uid not in (0, os.geteuid()):
            raise MemtopError(
                f"{folder} is a symbolic link owned by uid {above.st_uid}: memtop does not write "
                "through another user's link; give the real directory"
            )
    if not path.parent.is_dir():
        raise MemtopError(f"no such directory: {path.parent}")
    return path
