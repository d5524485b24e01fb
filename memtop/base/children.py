"""Child processes that never outlive the process that started them.

One home for what `memtop demo`, the benches (bench/) and the tests do with the processes they
start: start one and wait for the first line it prints, start one on a terminal of its own,
stop a group of them (a signal, a shared deadline, then SIGKILL), turn SIGTERM and SIGHUP
into the same clean exit as Ctrl-C so that `finally` blocks stop the children (a bench stopped
by `timeout`, a demo whose terminal closed), and, in the child, end when the parent is gone
even when the parent could not stop it (SIGKILL, a crash): PR_SET_PDEATHSIG on Linux, and a
poll of the parent pid everywhere.

It is also the one home of how memtop starts a Python of its own (python_command): isolated
from the directory it was started in and from import paths someone else controls.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from memtop.base.untrusted import root_may_not_load

PARENT_POLL_S = 0.5  # how often a child looks whether its parent is still there
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_TIMEOUT_S = 5.0
# The folder that holds the running memtop package: a dev checkout on PYTHONPATH, or
# site-packages.  This process imported memtop from it already, so its children may too.
MEMTOP_PARENT = str(Path(__file__).resolve().parents[2])

# What a child runs under `python -I -c`: the import path entries this process chose are put
# in front (as PYTHONPATH entries would be), after a first entry that stands where `python -m`
# puts the current directory: the interpreter's own folder, as memtop's console script has its
# bin/ there (`memtop run` replaces that first entry with the program's folder); then the module
# runs as `python -m` would run it.
_BOOT = (
    "import os, sys, runpy; "
    "sys.path[:0] = [os.path.dirname(sys.executable)]"
    " + [p for p in {paths!r} if p not in sys.path]; "
    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
)


def python_command(module: str, *args: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The command that runs `python -m module args` with this interpreter, isolated.

    `python -m` puts the current directory first on the import path: root running
    `memtop demo` in a folder where another user made `memtop/` (or `json.py`) ran that user's
    code as root.  Here the child starts with `-I` (no current directory, no PYTHONPATH, no
    user site-packages; `-P` alone needs Python 3.11) and gets back, explicitly, the folder
    that holds this memtop and the PYTHONPATH entries (of `environ`, default ours) that
    import_paths keeps: it imports the same memtop and dependencies as this process."""
    paths = import_paths(os.environ if environ is None else environ)
    return [sys.executable, "-I", "-c", _BOOT.format(paths=paths, module=module), *args]


def import_paths(environ: Mapping[str, str]) -> list[str]:
    """PYTHONPATH's entries, made absolute, then the folder holding this memtop, for a child
    started by python_command.  Empty entries (which name the current directory) are dropped;
    as root, so is every entry another user could write (untrusted.root_may_not_load)."""
    paths = []
    for entry in environ.get("PYTHONPATH", "").split(os.pathsep):
        if not entry:
            continue
        entry = os.path.abspath(entry)
        if os.geteuid() == 0 and root_may_not_load(entry) is not None:
            continue
        paths.append(entry)
    if MEMTOP_PARENT not in paths:
        paths.append(MEMTOP_PARENT)
    return paths


def start_until_first_line(
    command: list[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    stderr: int = subprocess.DEVNULL,
    timeout: float = 60.0,
) -> tuple[subprocess.Popen[str], str]:
    """Start `command` with its output on a pipe and wait until it prints its first line (a
    demo's banner, a trainer's first steps, an exporter's address): it is up then.  Returns the
    process and that line ("" when it exited or said nothing within `timeout`; the caller says
    why, with the process's stderr if it asked for it with `stderr=subprocess.PIPE`)."""
    process = subprocess.Popen(
        command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=stderr, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        return process, process.stdout.readline() if ready else ""
    except BaseException:
        stop(process)
        raise


def start_in_terminal(
    command: list[str],
    size: tuple[int, int],
    env: Mapping[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `command` on a pseudo-terminal of `size` (columns, rows), in a session of its own
    as a shell starts a program.  Returns the process and the terminal's master end, which the
    caller reads (what the program paints) and closes: only the child holds the other end, so
    its exit ends those reads with EIO."""
    master, slave = os.openpty()
    columns, rows = size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    try:
        process = subprocess.Popen(
            command, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            preexec_fn=preexec_fn,
        )  # fmt: skip
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return process, master


def die_with_parent(
    parent: int, on_gone: Callable[[], None], sig: int = signal.SIGTERM
) -> threading.Thread | None:
    """In a child: call `on_gone` once `parent` is no longer its parent (it exited, was killed,
    crashed).  On Linux the kernel also sends `sig` the moment the parent dies (the child's
    handler for `sig` should stop it).  Returns the polling thread (None: the parent is gone
    already, and `on_gone` was called).

    Linux sends the signal when the *thread* that started the child ends: start children that
    call this from a thread that lives as long as the parent (the main thread)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above: no signal will come
        on_gone()
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        on_gone()

    thread = threading.Thread(target=watch, name="memtop-parent-watch", daemon=True)
    thread.start()
    return thread


def signalled_when_parent_dies(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for a child that does not watch its parent itself (a trainer under
    `memtop run` started by a bench): Linux sends it `sig` when the thread that started it ends,
    so a crashed or killed parent leaves no orphan burning CPU.  None off Linux.  libc is
    loaded here, in the parent: the forked child only calls into it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec


def stop_all(
    processes: Iterable[subprocess.Popen[Any]],
    sig: int = signal.SIGTERM,
    timeout: float = STOP_TIMEOUT_S,
) -> None:
    """Send `sig` to every process still running, wait for them all until one shared deadline,
    then SIGKILL what is left (and reap it)."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()


def stop(
    process: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S
) -> int:
    """`stop_all` of one process; its exit code."""
    stop_all([process], sig, timeout)
    return process.returncode


class StopFlag:
    """A stop that a signal handler may raise, and the main thread wait on.

    Not threading.Event: its set() takes the Event's lock, and a handler runs on the main thread
    between two bytecodes, possibly while that thread holds the same lock inside Event.wait():
    the handler then waits for itself for ever.  A simulated trainer hung so in CI on its second
    SIGTERM, and a storm of signals hung an Event-waiting loop in 7 runs of 8.  Here raising is
    a plain store and a byte written to a non-blocking pipe (both safe in a handler and from any
    thread), and waiting is a select on the pipe."""

    def __init__(self) -> None:
        self._raised = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._raised = True
        with contextlib.suppress(OSError):  # a full pipe: the waiters are woken already
            os.write(self._write, b"\0")

    def is_set(self) -> bool:
        return self._raised

    def wait(self, timeout: float | None = None) -> bool:
        """Until raised or `timeout` seconds; whether it is raised."""
        if not self._raised:
            select.select([self._read], [], [], timeout)
        return self._raised


# A stop asked for by a signal, remembered for the process: the KeyboardInterrupt a handler
# raises can be swallowed where Python ignores exceptions (a weakref callback of the import
# machinery, while Textual is being imported), and whoever takes the signals over next (the
# dashboard's terminal driver) must still see that the user asked it to end.
_stop_requested = StopFlag()


def request_stop() -> None:
    _stop_requested.set()


def stop_requested() -> bool:
    return _stop_requested.is_set()


def wait_for_stop(timeout: float) -> bool:
    return _stop_requested.wait(timeout)


@contextlib.contextmanager
def interrupted_by_signals(
    signals: Iterable[int] = (signal.SIGTERM, signal.SIGHUP),
) -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does: the
    default action ends Python at once and skips every `finally` that stops a child.  Only on
    the main thread (where Python runs signal handlers); the previous handlers come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        request_stop()
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_stopping_children(main: Callable[[], int | None]) -> int:
    """A script's `main`, unwound by Ctrl-C, SIGTERM (`timeout`) and SIGHUP alike, so that its
    `finally` blocks stop what it started; 130 then, with one line instead of a traceback."""
    try:
        with interrupted_by_signals():
            return main() or 0
    except KeyboardInterrupt as exc:
        why = str(exc) or "Ctrl-C"
        print(
            f"{Path(sys.argv[0]).name}: interrupted ({why}); what it started is stopped",
            file=sys.stderr,
        )
        return 130
