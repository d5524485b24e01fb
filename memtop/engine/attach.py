"""Attach: start the agent inside a Python process that is already running (`memtop attach PID`,
the dashboard's `a` key).

The run that needs memtop most is the one that has trained for two days and creeps toward OOM;
its owner will not restart it.  Like memray's attach, memtop runs a few lines of Python inside
the live interpreter:
- Python >= 3.14: `sys.remote_exec(pid, script)` (PEP 768), unless the target disabled remote
  debugging (PYTHON_DISABLE_REMOTE_DEBUG, -X disable_remote_debug);
- otherwise gdb: `gdb -p PID -batch` calls PyGILState_Ensure, PyRun_SimpleString and
  PyGILState_Release in the target.

What runs in the target only starts a daemon thread, which imports memtop and calls
`memtop.start_agent()`; nothing else happens on the thread gdb interrupted, and the agent then
keeps its usual thread discipline (steps are counted by torch's global optimizer hook from the
trainer's next `optimizer.step()`; tensors are only touched at step boundaries).  The names it
uses are not bound in the target's `__main__`.

memtop must be importable there: the target's own memtop if its environment has one, else this
memtop's package directory is appended to its sys.path, which needs the same Python version.

Refusals, each one line: no such process, another user's process, not a Python process, ptrace
forbidden (Yama ptrace_scope, no CAP_SYS_PTRACE), gdb missing, remote debugging disabled, memtop
not importable.  Attaching twice is a no-op: an agent already listening is reported, not doubled.

Root on a shared box (DESIGN §6): memtop, as root, never runs anything the target's user chose
with root's privileges.  What it knows of the target it reads from /proc (bounded); the one
question /proc cannot answer (can the target's interpreter import memtop?) is asked of that
interpreter in a child that runs as the target's uid, gid and groups, in a new session (no
terminal to type into), with an empty environment, `-I` (no PYTHONPATH, no user site, no current
directory on sys.path) and `/` as its directory; its output is bounded in size and time.  gdb
reads no init file, auto-loads nothing and asks no debuginfod server.  And root attaches to
another user's process only when told to (`--yes`, a y/N prompt, the dashboard's dialog), for
the uid that was named when it was asked.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from memtop import protocol
from memtop.base.errors import MemtopError
from memtop.base.records import record

# Seams for the tests (and for systems that keep these elsewhere).
YAMA_PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
SELF_STATUS = Path("/proc/self/status")
CAP_SYS_PTRACE = 19
GDB_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 15.0
PROBE_OUTPUT_LIMIT = 4096  # bytes kept of the probe's stdout: two short lines are expected
# /proc reads are bounded: argv and the environment are the target user's to make as large as
# the kernel lets them (ARG_MAX grows with the stack limit); maps of a torch trainer are < 1 MiB.
PROC_READ_LIMIT = 8 << 20
MEMTOP_PARENT = str(Path(__file__).resolve().parents[2])  # the folder holding memtop/
_PYTHON_LIB = re.compile(r"(?:^|/)(?:lib)?python(\d)\.(\d+)[a-z]*(?:\.so[.\d]*|$)")


class AttachError(MemtopError):
    """Attaching did not work; one line saying why."""


class AttachRefused(AttachError):
    """memtop will not (or cannot) attach; one line saying why."""


@record(frozen=True)
class Attached:
    pid: int
    socket: str
    method: str | None  # "gdb" or "remote_exec"; None: an agent was already listening
    command: str

    @property
    def message(self) -> str:
        if self.method is None:
            return f"pid {self.pid} already has an agent listening on {self.socket}: nothing to do"
        return (
            f"attached to pid {self.pid} ({self.command}) with {self.method}: agent on "
            f"{self.socket}; steps are counted from its next optimizer.step()"
        )


@dataclass
class Target:
    """What memtop needs to know about the process it attaches to."""

    pid: int
    uid: int
    exe: str  # the interpreter as the target runs it (a venv's python, not its base binary)
    cwd: str
    environ: dict[str, str]
    argv: list[str]
    version: tuple[int, int] | None = None
    has_memtop: bool = False
    problems: list[str] = field(default_factory=list)
    gid: int | None = None  # the target's effective gid and groups: what the probe runs with
    groups: list[int] = field(default_factory=list)

    @property
    def owner(self) -> str:
        """`alice (uid 1001)`: whose process this is, for a question or a refusal."""
        return describe_uid(self.uid)

    @property
    def foreign(self) -> bool:
        """Root attaching to another user's process: asked first, the probe drops to its uid."""
        return os.geteuid() == 0 and self.uid != 0

    @property
    def socket_dir(self) -> Path:
        """The socket directory the agent will pick inside the target."""
        return protocol.socket_dir(self.environ, self.uid)

    @property
    def remote_debug_disabled(self) -> bool:
        if self.environ.get("PYTHON_DISABLE_REMOTE_DEBUG"):
            return True
        flags = self.argv[1:]
        return (
            any(
                a == "disable_remote_debug" and flags[i - 1] == "-X"
                for i, a in enumerate(flags)
                if i
            )
            or "-Xdisable_remote_debug" in flags
        )


# ------------------------------------------------------------------ attaching


def attach(pid: int, wait: float = 10.0, consent_uid: int | None = None) -> Attached:
    """Start the agent in `pid` and wait until it answers; raises AttachError with one line.

    As root, another user's process is attached to only with `consent_uid` equal to its uid:
    the caller asked (and named the owner) first.  Checked here, on the process as it is now,
    so a pid reused by another user's process between the question and this call is refused."""
    target = read_target(pid)
    if target.foreign and consent_uid != target.uid:
        raise AttachRefused(consent_refusal(target))
    _probe_environment(target)
    existing = _agent_answers(target, timeout=2.0)
    if existing:
        return Attached(pid, existing, None, _command(target))
    method = choose_method(target)
    # Appended, so that the target's own memtop wins where it has one; this one is a fallback
    # only an interpreter of the same version may take.
    same_version = target.version == sys.version_info[:2]
    code = injected_code(MEMTOP_PARENT if same_version else None)
    if method == "remote_exec":
        _remote_exec(target, code)
    else:
        _gdb_inject(target, code)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        path = _agent_answers(target, timeout=1.0)
        if path:
            return Attached(pid, path, method, _command(target))
        time.sleep(0.2)
    raise AttachError(
        f"memtop's code ran in pid {pid} but no agent answered within {wait:g} s; "
        "its stderr says why (or its main thread has not run Python since)"
    )


def _command(target: Target) -> str:
    # Another user's argv, shown on root's terminal: control characters made inert.
    text = " ".join(" ".join(target.argv).split()) or target.exe
    return protocol.clean_text(text if len(text) <= 60 else text[:57] + "...")


def consent_refusal(target: Target) -> str:
    return (
        f"pid {target.pid} ({_command(target)}) belongs to {target.owner} and memtop runs as "
        f"root: add --yes to attach to it anyway"
    )


def consent_question(target: Target) -> str:
    return (
        f"pid {target.pid} ({_command(target)}) belongs to {target.owner}, not to root. Attach "
        "to it? It is paused a moment (ptrace) while memtop's agent starts inside it, running "
        "as its user. [y/N] "
    )


def describe_uid(uid: int) -> str:
    """`alice (uid 1001)`, or `uid 1001` for a uid without a name."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return f"uid {uid}"
    return f"{protocol.clean_text(name, 64)} (uid {uid})"


# ------------------------------------------------------------------ what the target is


def inspect(pid: int) -> Target:
    """The facts about `pid` every later check needs; refuses what cannot be attached at all."""
    target = read_target(pid)
    _probe_environment(target)
    return target


def read_target(pid: int) -> Target:
    """What /proc says of `pid` (bounded reads, nothing executed): its owner, argv, environment,
    interpreter and Python version.  Refuses a process that is gone, unreadable, not Python."""
    proc = Path(f"/proc/{pid}")
    try:
        uid = proc.stat().st_uid
    except (FileNotFoundError, ValueError):
        raise AttachRefused(f"no process {pid}") from None
    if pid == os.getpid():
        raise AttachRefused("memtop cannot attach to itself")
    me = os.geteuid()
    if me != 0 and uid != me:
        raise AttachRefused(
            f"pid {pid} belongs to {describe_uid(uid)}: attach as that user (or as root)"
        )
    refusal = container_refusal(pid)
    if refusal is not None:
        raise AttachRefused(refusal)
    name = "exe"
    try:
        exe = os.readlink(proc / "exe")
        name = "cwd"
        cwd = os.readlink(proc / "cwd")
        name = "cmdline"
        argv = [a.decode(errors="replace") for a in _read_proc(proc / name).split(b"\0")]
        name = "environ"
        environ = dict(
            item.decode(errors="replace").partition("=")[::2]
            for item in _read_proc(proc / name).split(b"\0")
            if b"=" in item
        )
        name = "maps"
        maps = _read_proc(proc / name).decode(errors="replace")
        name = "status"
        status = _read_proc(proc / name, 64 << 10).decode(errors="replace")
    except PermissionError:
        raise AttachRefused(unreadable(pid, name, me)) from None
    except (FileNotFoundError, ProcessLookupError):
        raise AttachRefused(f"no process {pid}") from None
    argv = [a for a in argv if a] or [exe]
    target = Target(pid, uid, exe, cwd, environ, argv)
    target.gid, target.groups = _credentials(status)
    target.version = python_version(exe, maps)
    if target.version is None:
        raise AttachRefused(f"pid {pid} ({_command(target)}) is not a Python process")
    return target


def container_refusal(pid: int) -> str | None:
    """Why memtop does not attach to `pid` from here: it runs in another pid namespace (a
    container).  Its interpreter, its memtop and the socket directory its agent would use are
    paths of the container's mount namespace, which memtop does not enter from the host (what
    it would check and load there is not what the target runs); inside the container, attach
    works as anywhere."""
    from memtop.protocol import namespaces

    theirs = namespaces.pid_namespace(pid)
    ours = namespaces.own_pid_namespace()
    if theirs is None or ours is None or theirs == ours:
        return None
    inside = namespaces.innermost_pid(pid)
    as_pid = f" (pid {inside} there)" if inside is not None else ""
    return (
        f"pid {pid} runs in another pid namespace (a container){as_pid}: memtop attaches only "
        "within its own; run `memtop attach` inside the container (docker exec, kubectl exec), "
        "or start the trainer under `memtop run` with MEMTOP_SOCKET_DIR on a directory shared "
        "with the host"
    )


def unreadable(pid: int, name: str, me: int) -> str:
    """Why /proc/PID/<name> could not be read, truthful for who memtop runs as."""
    if me == 0:
        return (
            f"the kernel does not let root read /proc/{pid}/{name} (the process is not "
            "dumpable, runs in another user namespace or is confined by a security module): "
            "memtop cannot attach to it"
        )
    return (
        f"cannot read /proc/{pid}/{name} although the process is yours (it changed its "
        "credentials and is not dumpable, or /proc hides it): try memtop attach as root"
    )


def _read_proc(path: Path, limit: int = PROC_READ_LIMIT) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(limit)


def _credentials(status: str) -> tuple[int | None, list[int]]:
    """The effective gid and the supplementary groups from /proc/PID/status."""
    gid = None
    groups: list[int] = []
    for line in status.splitlines():
        key, _, value = line.partition(":")
        with contextlib.suppress(ValueError, IndexError):
            if key == "Gid":
                gid = int(value.split()[1])
            elif key == "Groups":
                groups = [int(g) for g in value.split()]
    return gid, groups


def python_version(exe: str, maps: str) -> tuple[int, int] | None:
    """The CPython version of a process from its binary or its libpython mapping."""
    for name in [exe, *(line.rsplit(" ", 1)[-1] for line in maps.splitlines())]:
        match = _PYTHON_LIB.search(name)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


# Run by the target's base interpreter (/proc/PID/exe), as the target's user, with -I -S: finds
# the interpreter as the target ran it (argv[0] through its PATH and directory: a virtualenv's
# `python` is a link to the base binary, and only the link knows the venv's site-packages), says
# which, and becomes it to run PROBE.  The lookup runs as that user, so it sees what they see.
LOCATE = """\
import os, sys
exe, first, cwd, path = sys.argv[1:5]
candidates = []
if os.sep in first:
    candidates.append(os.path.join(cwd, first))
else:
    for folder in path.split(os.pathsep):
        if folder:
            candidates.append(os.path.join(os.path.join(cwd, folder), first))
real = os.path.realpath(exe)
chosen = next(
    (c for c in candidates if os.path.isfile(c) and os.path.realpath(c) == real), exe
)
sys.stdout.write("memtop-probe-exe " + chosen.encode("unicode_escape").decode() + "\\n")
sys.stdout.flush()
os.execv(chosen, [chosen, *sys.argv[5:]])
"""
# Whether memtop can be imported there (find_spec only: nothing of memtop runs).
PROBE = (
    "import importlib.util, sys; "
    "print('memtop-probe', *sys.version_info[:2], int(importlib.util.find_spec('memtop') "
    "is not None))"
)


def _probe_environment(target: Target) -> None:
    """Ask the target's interpreter whether it can import memtop (and its exact version), as
    the target's user: see the module's docstring for the isolation.  Whatever goes wrong is a
    problem noted, not a refusal: the binary is there (the process runs it)."""
    command = [
        target.exe,
        "-I",
        "-S",
        "-c",
        LOCATE,
        target.exe,
        target.argv[0],
        target.cwd,
        target.environ.get("PATH", ""),
        # -I: no PYTHONPATH, no user site, no current directory; site-packages (the venv's or
        # the system's) stays, as the target sees it.  The target's own -S / -s / -E keep.
        "-I",
        *interpreter_flags(target.argv),
        "-c",
        PROBE,
    ]
    as_target = target.uid != os.geteuid()  # root and another user's process
    if as_target and target.gid is None:
        target.problems.append(f"could not ask {target.exe} about memtop (no gid known)")
        return
    try:
        if as_target:
            output = _run_bounded(command, target.uid, target.gid, target.groups)
        else:
            output = _run_bounded(command)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        target.problems.append(f"could not ask {target.exe} about memtop ({type(exc).__name__})")
        return
    for line in output.decode(errors="replace").splitlines():
        tag, _, rest = line.partition(" ")
        words = rest.split(" ")
        if tag == "memtop-probe-exe":
            with contextlib.suppress(UnicodeError):
                target.exe = protocol.clean_text(rest.encode().decode("unicode_escape"))
        elif tag == "memtop-probe" and len(words) == 3 and all(w.isdigit() for w in words):
            target.version = (int(words[0]), int(words[1]))
            target.has_memtop = words[2] == "1"
            return
    target.problems.append(f"could not ask {target.exe} about memtop (no answer)")


def _run_bounded(
    command: list[str],
    uid: int | None = None,
    gid: int | None = None,
    groups: list[int] | None = None,
) -> bytes:
    """stdout of `command` (at most PROBE_OUTPUT_LIMIT bytes, within PROBE_TIMEOUT_S), run as
    `uid`, `gid` and `groups` (default: ours), in a session of its own, from `/`, with an empty
    environment; the whole session is killed on the way out."""
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd="/",
        env={},
        start_new_session=True,  # no controlling terminal: nothing to type into root's shell
        user=uid,
        group=gid,
        extra_groups=groups,
    )
    assert process.stdout is not None
    output = b""
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        fd = process.stdout.fileno()
        while len(output) <= PROBE_OUTPUT_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0:
                break  # what came so far is parsed; no answer is a problem noted
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, PROBE_OUTPUT_LIMIT + 1)
                if not chunk:
                    break
                output += chunk
    finally:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.stdout.close()
        process.wait()
    return output[:PROBE_OUTPUT_LIMIT]


def interpreter_flags(argv: list[str]) -> list[str]:
    """The target's flags that change what it can import (-I, -S, -s, -E, -P)."""
    flags = []
    for arg in argv[1:]:
        if not arg.startswith("-") or arg in ("-c", "-m", "-") or not arg[1:].isalpha():
            break
        letters = [c for c in arg[1:] if c in "ISsEP"]
        if len(letters) == len(arg) - 1:
            flags.append(arg)
    return flags


# ------------------------------------------------------------------ may we, and how


def choose_method(target: Target) -> str:
    """ "remote_exec" or "gdb", or a refusal saying why neither can be used."""
    version = target.version or (0, 0)
    if version < (3, 10):
        raise AttachRefused(
            f"pid {target.pid} runs Python {version[0]}.{version[1]}; the agent needs 3.10 or newer"
        )
    if not target.has_memtop and version != sys.version_info[:2]:
        raise AttachRefused(
            f"memtop is not installed in the environment of pid {target.pid} (Python "
            f"{version[0]}.{version[1]}), and this memtop runs on Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}: install memtop there "
            f"(`{target.exe} -m pip install memtop-gpu`) and run its `memtop attach`"
        )
    if version >= (3, 14) and target.remote_debug_disabled:
        raise AttachRefused(
            f"pid {target.pid} disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG or -X "
            "disable_remote_debug): start it under `memtop run` instead"
        )
    check_ptrace(target)
    if version >= (3, 14) and sys.version_info >= (3, 14) and hasattr(sys, "remote_exec"):
        return "remote_exec"
    if shutil.which("gdb") is None:
        raise AttachRefused(
            "gdb is not installed (apt-get install gdb / dnf install gdb); memtop attaches to "
            "Python < 3.14 with gdb"
        )
    return "gdb"


def check_ptrace(target: Target) -> None:
    """Refuse where the kernel will not let us trace `target` (Yama, capabilities)."""
    scope = _read_int(YAMA_PTRACE_SCOPE)
    privileged = has_cap_sys_ptrace()
    fix = "run memtop attach as root, or `sudo sysctl kernel.yama.ptrace_scope=0`"
    if scope == 3:
        raise AttachRefused(
            "ptrace is disabled on this machine (kernel.yama.ptrace_scope = 3, until reboot): "
            "start the trainer under `memtop run` instead"
        )
    if scope == 2 and not privileged:
        raise AttachRefused(
            "ptrace is reserved to administrators here (kernel.yama.ptrace_scope = 2) and memtop "
            "lacks CAP_SYS_PTRACE: run memtop attach as root"
        )
    if scope == 1 and not privileged:
        raise AttachRefused(
            "ptrace is limited to a process's parent here (kernel.yama.ptrace_scope = 1) and "
            f"memtop lacks CAP_SYS_PTRACE: {fix}"
        )
    if target.uid != os.geteuid() and not privileged:
        raise AttachRefused(
            f"pid {target.pid} belongs to uid {target.uid} and memtop lacks CAP_SYS_PTRACE "
            "(a container without SYS_PTRACE?)"
        )


def has_cap_sys_ptrace() -> bool:
    try:
        for line in SELF_STATUS.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # no Yama: classic ptrace rules


# ------------------------------------------------------------------ what runs in the target


AGENT_STARTER = """\
import sys
try:
    if PATH is not None and PATH not in sys.path:  # PATH: set on the line before
        sys.path.append(PATH)
    import memtop
    memtop.start_agent(quiet=False)
except Exception as exc:
    sys.stderr.write(f"memtop: agent not started: {exc}\\n")
"""


def injected_code(extra_path: str | None) -> str:
    """One line of Python for the target: a daemon thread that runs AGENT_STARTER (import
    memtop, start the agent) in a namespace of its own.  Binds no name in the target's
    __main__; whatever fails is said on the target's stderr, never raised there."""
    source = f"PATH = {extra_path!r}\n{AGENT_STARTER}"
    return (
        f"__import__('threading').Thread(target=exec, args=({source!r}, {{}}), "
        "name='memtop-attach', daemon=True).start()"
    )


def _gdb_inject(target: Target, code: str) -> None:
    c_string = code.replace("\\", "\\\\").replace('"', '\\"')
    command = [
        "gdb",
        "-p",
        str(target.pid),
        "-batch",
        # gdb runs as memtop's user (root, maybe) on files the target's user may own: no init
        # file (-nx: neither ~/.gdbinit, ./.gdbinit nor the system's), no auto-loaded script
        # (libpython's -gdb.py, .debug_gdb_scripts, libthread_db), no debuginfod download.
        "-nx",
        "-q",
        "-iex",
        "set auto-load off",
        "-iex",
        "set debuginfod enabled off",
        # Symbols of libpython only: reading those of every library a trainer maps (torch's
        # are hundreds of MB) takes gdb ~20 s; with this, ~3 s.
        "-iex",
        "set auto-solib-add off",
        "-ex",
        "set confirm off",
        "-ex",
        "sharedlibrary libpython",
        "-ex",
        "call (int) PyGILState_Ensure()",
        "-ex",
        f'call (int) PyRun_SimpleString("{c_string}")',
        "-ex",
        "call (void) PyGILState_Release($1)",
    ]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=GDB_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            cwd="/",  # no file of anyone's current directory is near gdb
        )
    except subprocess.TimeoutExpired:
        raise AttachError(f"gdb did not finish within {GDB_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise AttachRefused(f"gdb could not run: {exc.strerror or exc}") from None
    why = gdb_failure(result.stdout + result.stderr)
    if why:
        raise AttachRefused(why)


def gdb_failure(output: str) -> str | None:
    """The one line to show for a gdb run that did not inject, or None when it did."""
    if "ptrace: Operation not permitted" in output:
        return (
            "the kernel refused ptrace (Yama ptrace_scope, or a container without SYS_PTRACE): "
            "run memtop attach as root, or start the trainer under `memtop run`"
        )
    if "No symbol table is loaded" in output or 'No symbol "PyGILState_Ensure"' in output:
        return (
            "the target's Python exports no C API symbols gdb can call (a static, stripped build?)"
        )
    if "ptrace: No such process" in output:
        return "the process is gone"
    results = re.findall(r"^\$(\d+) = (-?\d+)", output, re.MULTILINE)
    # $1: the GIL state, $2: PyRun_SimpleString's status (0 ran, -1 raised).
    if len(results) >= 2 and results[1][1] == "0":
        return None
    if len(results) >= 2:
        return "the injected code raised inside the target (its stderr says why)"
    last = [line for line in output.strip().splitlines() if line.strip()]
    return f"gdb could not run code in the target: {last[-1] if last else 'no output'}"


def _remote_exec(target: Target, code: str) -> None:
    # The script must stay readable until the target has run it: it runs at the target's next
    # eval-breaker check, which the attach's wait covers.
    with tempfile.NamedTemporaryFile(
        "w", prefix="memtop-attach-", suffix=".py", delete=False
    ) as handle:
        handle.write(code + "\n")
    os.chmod(handle.name, 0o644)  # the target may run as another user (memtop as root)
    try:
        sys.remote_exec(target.pid, handle.name)  # type: ignore[attr-defined]
    except (OSError, RuntimeError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise AttachRefused(f"sys.remote_exec failed: {exc}") from None


def record_stacks(pid: int, timeout: float = 5.0) -> str:
    """Ask the agent of `pid` (just attached, or there already) to record allocation stacks
    from its trainer's next step boundary (the `sites` command with `stacks: true`, as the
    dashboard's `w` key does); one line saying what happens, or AttachError with why not."""
    from memtop.sources.agents import AgentClient, AgentError, AgentUnreachable

    target = read_target(pid)
    try:
        with AgentClient(pid, target.socket_dir, timeout=timeout, owner=target.uid) as client:
            hello = client.connect(timeout=timeout)
            client.request("sites", {"stacks": True}, timeout=timeout)
    except (AgentUnreachable, AgentError, OSError) as exc:
        raise AttachError(f"attached, but stack recording was not switched on: {exc}") from None
    if not hello.devices:  # a CPU-only trainer: torch records no stacks for the CPU
        return (
            f"stack recording asked in pid {pid}, which uses no CUDA device yet: it starts at "
            "its first step on one (torch records no allocation stacks on the CPU)"
        )
    return (
        f"stack recording asked in pid {pid}: it starts at the trainer's next step; "
        "memtop's detail screen (enter) shows who holds the memory, by line"
    )


def _agent_answers(target: Target, timeout: float) -> str | None:
    """The socket of an agent answering as `target.pid`, or None."""
    from memtop.sources.agents import AgentClient, AgentError, AgentUnreachable

    directory = target.socket_dir
    path = protocol.socket_path(target.pid, directory)
    if not os.path.lexists(path):
        return None
    try:
        with AgentClient(target.pid, directory, timeout=timeout, owner=target.uid) as client:
            client.connect(timeout=timeout)
    except (AgentUnreachable, AgentError, OSError):
        return None
    return str(path)
