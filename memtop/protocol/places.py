"""Where agents listen and who they are: the socket directory (created 0700, refused when
another user owns it or others may write into it), the state and OOM directories, the pids behind
socket names, and the peer's credentials (SO_PEERCRED) checked before a byte is sent (DESIGN §6).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import signal
import socket
import stat
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from memtop.protocol import namespaces
from memtop.protocol.discovery import Discovery, SocketDirs
from memtop.protocol.procfs import process_start_ticks, stat_fields
from memtop.protocol.text import clean_text, decimal


class UnsafeSocketDir(Exception):
    """The socket directory exists but is not safe to use (owner or permissions)."""


class PeerRefused(Exception):
    """The process serving an agent socket is not who the socket says it is (or the socket or
    its directory is not what a real agent makes); the message is one line."""


def socket_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """`$XDG_RUNTIME_DIR/memtop/`, else `/tmp/memtop-<uid>/` (override: MEMTOP_SOCKET_DIR).

    Of this process by default; `memtop attach` passes its target's environment and uid to
    know where the agent it starts there will listen."""
    environ = os.environ if environ is None else environ
    override = environ.get("MEMTOP_SOCKET_DIR")
    if override:
        return Path(override)
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "memtop"
    return Path(f"/tmp/memtop-{os.getuid() if uid is None else uid}")


def check_socket_dir(path: Path, owner: int | None = None) -> None:
    """Refuse a directory another user owns or others could write into (socket hijacking).

    `owner` is the uid the directory must belong to (default: ours; root viewing other users'
    trainers passes theirs).
    """
    owner = os.getuid() if owner is None else owner
    mine = owner == os.getuid()
    # Our own directory taken by someone else (anyone can make /tmp/memtop-<uid> first, where
    # XDG_RUNTIME_DIR is unset): the refusal says how to get out of it.
    elsewhere = (
        ": set XDG_RUNTIME_DIR (your login session's /run/user/<uid>), or MEMTOP_SOCKET_DIR to a "
        "directory you own with mode 0700"
        if mine
        else ""
    )
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot inspect socket directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeSocketDir(
            f"socket directory {path} is not a directory (or is a symlink){elsewhere}"
        )
    if info.st_uid != owner:
        whom = "you" if mine else "uid"
        raise UnsafeSocketDir(
            f"socket directory {path} is owned by uid {info.st_uid}, not by {whom} ({owner})"
            f"{elsewhere}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        fix = f" (chmod 700 {path})" if mine else ""
        raise UnsafeSocketDir(
            f"socket directory {path} is group- or world-writable "
            f"(mode {stat.S_IMODE(info.st_mode):o}); expected 700{fix}"
        )


def ensure_socket_dir(path: Path | None = None) -> Path:
    """Create the socket directory 0700 if needed and check it; raise UnsafeSocketDir if unsafe."""
    path = path or socket_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot create socket directory {path}: {exc.strerror}") from None
    check_socket_dir(path)
    return path


def state_dir() -> Path:
    """Where memtop keeps files that outlive a trainer and the login session (the runtime
    directory of the sockets is removed at logout): `$XDG_STATE_HOME/memtop`
    (`~/.local/state/memtop`); an overridden socket directory (MEMTOP_SOCKET_DIR: tests, custom
    setups) holds them instead."""
    if os.environ.get("MEMTOP_SOCKET_DIR"):
        return socket_dir()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(state) / "memtop"


def oom_dir() -> Path:
    """Where agents write OOM reports and `memtop oom` reads them: MEMTOP_OOM_DIR, else `oom/`
    in the state directory."""
    override = os.environ.get("MEMTOP_OOM_DIR")
    if override:
        return Path(override)
    return state_dir() / "oom"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) 0700 and check it under the socket directory's rules:
    ours, a real directory, not group- or world-writable.  Raise UnsafeSocketDir otherwise."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot create directory {path}: {exc.strerror}") from None
    check_socket_dir(path)
    return path


def discover(finder: SocketDirs | None = None) -> Discovery:
    """Socket directories a viewer reads, each with the uid that owns it, and one line for each
    kind of directory it does not read.

    A normal user reads their own; root (who may attach to anyone's trainer) reads every
    user's, so `sudo memtop` on a shared box sees all the agents: each user's by its owner as
    lstat says, at a bounded cost per round (protocol.discovery).  `finder`: the one a viewer
    keeps from round to round (its verdicts cached); without it, one complete look."""
    mine = socket_dir()
    if os.geteuid() != 0 or os.environ.get("MEMTOP_SOCKET_DIR"):
        return Discovery([(mine, os.getuid())], [])
    if finder is None:
        return SocketDirs().scan((mine, os.getuid()), limit=0)
    return finder.scan((mine, os.getuid()))


def discovery_dirs() -> list[tuple[Path, int]]:
    """The socket directories `discover` reads, each with the uid that owns it."""
    return discover().dirs


def socket_path(pid: int, directory: Path | None = None) -> Path:
    """The socket of the agent of `pid`, a process in this process's pid namespace: `<pid>.sock`
    in the host's, `<pid>.ns<inode>.sock` in a container's (see protocol.namespaces)."""
    return (directory or socket_dir()) / namespaces.socket_name(pid, namespaces.own_pid_namespace())


def socket_pid(name: str) -> int | None:
    """The pid an agent socket's file name `<pid>.sock` stands for; None for any other name."""
    stem, dot, ext = name.partition(".")
    if ext != "sock" or not dot or len(stem) > 9:
        return None
    return decimal(stem)


def pid_exists(pid: int) -> bool:
    """Whether a process `pid` exists, zombies included (one system call)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    except OSError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process.  Zombies count as dead: an exited trainer that its
    parent has not reaped yet holds no GPU memory and serves no socket."""
    if not pid_exists(pid):
        return False
    tail = stat_fields(pid)
    if tail is None:
        return True  # exists, but /proc will not say more
    # The state letter follows the command name: a zombie (Z) or a dead one (X) is gone.
    return not (tail and tail[0] in (b"Z", b"X"))


def list_agent_sockets(directory: Path | None = None, remove_stale: bool = True) -> list[int]:
    """Pids with a socket in the directory (of processes in this pid namespace, as their agents
    name them: protocol.namespaces); sockets of dead pids are removed on the way."""
    directory = directory or socket_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    own = namespaces.own_pid_namespace()
    pids = []
    for name in names:
        parsed = namespaces.parse_socket_name(name)
        if parsed is None or parsed[1] not in (None, own):
            continue
        pid = parsed[0]
        if pid_alive(pid):
            pids.append(pid)
        elif remove_stale:
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
    return sorted(pids)


_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def peer_allowed(uid: int) -> bool:
    """Only the agent's own user, or root, may talk to it."""
    return uid == os.getuid() or uid == 0


def connect(pid: int, directory: Path | None = None, timeout: float = 2.0) -> socket.socket:
    """Connect to the agent of `pid` without checking who serves it (tests, the agent's own
    checks); viewers use connect_agent.  Raises OSError (ENOENT, ECONNREFUSED, EACCES) as is."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(socket_path(pid, directory)))
    except OSError:
        sock.close()
        raise
    return sock


def pid_owner(pid: int) -> int | None:
    """The real uid owning `pid` as /proc shows it (None: no such process visible here)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None


def check_socket_entry(path: Path, owner: int) -> None:
    """lstat one `<pid>.sock`: it must be a socket (not a symlink, not a file) owned by `owner`.
    Raises PeerRefused with the reason, or OSError (ENOENT) when it is not there."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PeerRefused(f"{path} is a symlink; memtop never follows one")
    if not stat.S_ISSOCK(info.st_mode):
        raise PeerRefused(f"{path} is not a socket")
    if info.st_uid != owner:
        raise PeerRefused(f"{path} belongs to uid {info.st_uid}, not to the directory's ({owner})")


def check_peer(sock: socket.socket, pid: int, owner: int) -> None:
    """The server at the other end must be process `pid` running as `owner` (SO_PEERCRED)."""
    try:
        peer_pid, peer_uid, _ = peer_credentials(sock)
    except OSError as exc:
        raise PeerRefused(f"cannot read the credentials of the agent of pid {pid}: {exc}") from None
    if peer_pid != pid:
        raise PeerRefused(f"the socket of pid {pid} is served by pid {peer_pid}: impersonation")
    if peer_uid != owner:
        raise PeerRefused(
            f"the agent of pid {pid} runs as uid {peer_uid}, not as the directory's owner {owner}"
        )


def connect_agent(
    pid: int,
    directory: Path,
    owner: int | None = None,
    timeout: float = 2.0,
    name: str | None = None,
) -> socket.socket:
    """Connect to the agent of `pid` in `directory` (owned by `owner`, default: us) and make
    sure it is that agent: see connect_agent_process, whose socket this is."""
    return connect_agent_process(pid, directory, owner, timeout, name)[0]


def connect_agent_process(
    pid: int,
    directory: Path,
    owner: int | None = None,
    timeout: float = 2.0,
    name: str | None = None,
) -> tuple[socket.socket, int | None]:
    """Connect to the agent of `pid` in `directory` (owned by `owner`, default: us) and make
    sure it is that agent: the directory and the socket are checked with lstat (no symlink
    followed), the server's SO_PEERCRED must show pid `pid` and uid `owner`, and that pid must
    still be the very process that opened the socket (check_peer_process).  Nothing is sent
    before these checks pass.  Returns the socket and the process's start time (clock ticks
    since boot, /proc/PID/stat field 22; None where it cannot be read), which tells that
    process from any later one given the same pid.  Raises UnsafeSocketDir or PeerRefused
    (refused) or OSError (not reachable).

    `name`: the socket's file name when `pid` (as this viewer sees it) runs in another pid
    namespace (`<its pid>.ns<inode>.sock`); the server must then be `pid` AND be that process
    of that namespace (protocol.namespaces)."""
    owner = os.getuid() if owner is None else owner
    check_socket_dir(directory, owner)
    path = directory / name if name is not None else socket_path(pid, directory)
    check_socket_entry(path, owner)
    process_owner = pid_owner(pid)
    if process_owner is not None and process_owner != owner:
        raise PeerRefused(
            f"pid {pid} belongs to uid {process_owner}; a socket in uid {owner}'s directory "
            "cannot speak for it"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        # The socket could have been swapped between lstat and connect (only by the directory's
        # owner, who could equally run a fake agent): the peer's credentials settle it.
        check_peer(sock, pid, owner)
        if name is not None and namespaces.expected_socket_name(pid) != name:
            raise PeerRefused(f"pid {pid} is not the process {name} stands for")
        started = check_peer_process(sock, pid, path)
    except BaseException:
        sock.close()
        raise
    return sock, started


# SO_PEERPIDFD (Linux >= 6.5): a pidfd for the process that opened the peer socket.  Python's
# socket module has the constant from 3.13 on; its value is fixed by the kernel's ABI.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


class PidfdUnsupported(Exception):
    """This kernel has no SO_PEERPIDFD (older than 6.5): identity falls back on start times."""


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd for the process that opened the other end of `sock` (its listener's, for an
    agent socket), or None when that process has exited (it cannot be signalled, whatever
    now has its pid).  Raises PidfdUnsupported on kernels without SO_PEERPIDFD."""
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in (errno.ENOPROTOOPT, errno.EOPNOTSUPP):
            raise PidfdUnsupported from None
        if exc.errno in (errno.ESRCH, errno.EINVAL, errno.ENODATA):
            return None  # kernels before 6.16 refuse a pidfd for a reaped process
        raise
    if pidfd_pid(fd) in (None, -1):  # newer kernels give one, for a process with no pid
        os.close(fd)
        return None
    return fd


def pidfd_pid(fd: int) -> int | None:
    """The pid (in this process's pid namespace) of the process `fd` refers to; -1 when it has
    exited, None when it cannot be read."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as fh:
            for line in fh.read(4096).splitlines():
                if line.startswith(b"Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _boot_time() -> float:
    """When the machine booted, in wall-clock seconds, to the microsecond (/proc/stat's btime
    is whole seconds): the base of a process's start time."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


# A process cannot have opened a socket made before it started; clock ticks and a wall clock
# set meanwhile blur the comparison by this much.
START_SLACK_S = 1.0


def check_peer_process(sock: socket.socket, pid: int, path: Path) -> int | None:
    """`pid` (SO_PEERCRED's, the number the kernel kept when the listener was made) must still
    be the process that opened the agent socket: a process that passes its listening socket to
    a child and exits leaves its pid to be reused, and the socket would then speak for whoever
    got the number.  With SO_PEERPIDFD (Linux >= 6.5) the kernel says it; elsewhere a process
    that started after the socket was made cannot be the one that made it.  Returns the
    process's start time (process_start_ticks); raises PeerRefused."""
    gone = (
        f"the process that opened the agent socket of pid {pid} has exited; pid {pid} is now "
        "another process (the socket is served by a process it handed it to)"
    )
    try:
        fd = peer_pidfd(sock)
    except PidfdUnsupported:
        fd = -1
    except OSError as exc:
        raise PeerRefused(
            f"cannot identify the process behind the socket of pid {pid}: {exc.strerror or exc}"
        ) from None
    if fd is None:
        raise PeerRefused(gone)
    if fd >= 0:
        try:
            if pidfd_pid(fd) != pid:
                raise PeerRefused(gone)
            started = process_start_ticks(pid)
            # Still that process once its start time was read (so it was its /proc entry).
            signal.pidfd_send_signal(fd, 0)
        except ProcessLookupError:
            raise PeerRefused(gone) from None
        except PermissionError:
            pass  # alive; another user's (the owner check above is the pidfd's as well)
        finally:
            os.close(fd)
        return started
    started = process_start_ticks(pid)
    try:
        made = os.lstat(path).st_mtime
    except OSError:
        return started
    if started is not None:
        started_at = _boot_time() + started / os.sysconf("SC_CLK_TCK")
        if started_at > made + START_SLACK_S:
            raise PeerRefused(gone)
    return started


def user_name(uid: int) -> str:
    """`name` (uid N) from the passwd database, or `uid N` alone; made inert (it is text from
    outside memtop)."""
    try:
        name = clean_text(pwd.getpwuid(uid).pw_name, 64)
    except (KeyError, OverflowError):
        return f"uid {uid}"
    return f"{name}, uid {uid}" if name != str(uid) else f"uid {uid}"


def unmapped_here(pid: int) -> str | None:
    """Why the agent of `pid` cannot know who this viewer is, when that is so: it runs in a user
    namespace of its own (a rootless or user-namespaced container) that does not map this
    process's uid, so it sees this viewer as the overflow uid (65534) and, rightly, refuses it.
    None when `pid` shares our user namespace, or maps our uid, or when /proc does not say."""
    try:
        if os.stat(f"/proc/{pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino:
            return None
        with open(f"/proc/{pid}/uid_map", "rb") as fh:
            uid_map = fh.read(65536)
    except OSError:
        return None
    uid = os.geteuid()
    for line in uid_map.splitlines():
        # "first uid inside, first uid outside (as this reader's namespace sees it), count"
        fields = line.split()
        try:
            outside, count = int(fields[1]), int(fields[2])
        except (IndexError, ValueError):
            return None
        if outside <= uid < outside + count:
            return None
    try:
        with open("/proc/sys/kernel/overflowuid", "rb") as fh:
            overflow = int(fh.read(32))
    except (OSError, ValueError):
        overflow = 65534
    return (
        f"the agent of pid {pid} refuses this viewer: it runs in a user namespace (a container) "
        f"that does not map uid {uid}, so there this viewer is uid {overflow}, the overflow "
        "uid; run memtop inside the container, or as the user the container's root maps to"
    )


def describe_connect_error(pid: int, exc: OSError) -> str:
    """A one-line reason a viewer could not reach an agent (only what is known)."""
    if exc.errno == errno.ENOENT and not pid_alive(pid):
        return f"no process {pid}"
    owner = pid_owner(pid)
    if exc.errno == errno.ENOENT and owner is not None and owner != os.getuid():
        whom = user_name(owner)
        return (
            f"pid {pid} belongs to another user ({whom}): its agent, if it has one, listens in "
            "that user's socket directory, which you cannot reach; run memtop as root (sudo)"
            + ("" if owner == 0 else " or as that user")
        )
    if exc.errno == errno.ENOENT:
        return (
            f"no agent socket for pid {pid}: start it under `memtop run`, or add an agent with "
            f"`memtop attach {pid}`"
        )
    if exc.errno == errno.ECONNREFUSED:
        return f"nothing listens on the agent socket of pid {pid}: not reachable"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on the agent socket of pid {pid} (another user's process)"
    if isinstance(exc, TimeoutError):
        return f"the agent of pid {pid} did not accept the connection in time: not reachable"
    return f"cannot reach the agent of pid {pid}: {exc.strerror or exc}"
