"""Textual's Linux driver, with an input thread that sleeps until there is input.

Textual's input thread wakes ten times a second (`select(0.1)`) to give its key parser a
chance to time out a lone ESC, whether or not a key is half-read.  On a dashboard that sits
for hours with nobody typing that is ~1 ms of CPU a second, about 5 % of memtop's whole cost
(measured: bench/tui_cost.py, 8 GPUs).  Here the thread blocks in `select` with no timeout
while the parser holds nothing, with the parser's own deadline while it does, and a pipe wakes
it when the driver stops reading input (quit, suspend).

The loop is Textual's own (textual/drivers/linux_driver.py, `run_input_thread`) with only the
timeout and the wake-up pipe changed; should a later Textual rename what it relies on
(`XTermParser._timeout_time`), it falls back to Textual's 0.1 s.

A terminal that goes away without a SIGHUP (a closed pty master: a bench, a dropped container
exec, some IDE terminals) makes every read fail with EIO or return EOF, and Textual's loop then
spun at ~60 % of a core for ever.  Here a read that says the terminal is gone ends the app
within moments: the terminal's descriptors are pointed at /dev/null (the frames, Textual's
restoring sequences and memtop's last words go nowhere instead of failing) and the app exits
as after `q`, so everything the exit path stops (a demo's trainers) is stopped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import signal
import stat
import threading
from codecs import getincrementaldecoder
from collections.abc import Callable
from typing import IO, Any

from textual._parser import ParseError
from textual._time import get_time
from textual._xterm_parser import XTermParser
from textual.drivers.linux_driver import LinuxDriver

from memtop.base import children

FALLBACK_TIMEOUT_S = 0.1  # Textual's own poll, when the parser's deadline cannot be read


def parser_timeout(parser: object) -> float | None:
    """How long the input thread may sleep: None (until input) while the parser waits for
    nothing, else until its deadline (a lone ESC becomes the Escape key then)."""
    deadline = getattr(parser, "_timeout_time", FALLBACK_TIMEOUT_S)
    if deadline is FALLBACK_TIMEOUT_S:
        return FALLBACK_TIMEOUT_S
    if deadline is None:
        return None
    return max(0.0, float(deadline) - get_time())


# What a read or write of a terminal that is gone fails with (EIO: a pty whose master closed).
GONE_ERRNOS = (errno.EIO, errno.ENXIO, errno.EBADF, errno.EPIPE)


class TerminalGone(Exception):
    """The terminal's input reached EOF or fails: nobody can see or type into this app."""


class _TerminalOutput:
    """Textual's output file, for its writer thread: a write that fails because the terminal
    is gone says so (once) and is dropped, so the writer thread lives on and the app's frames
    never block on its full queue while the app exits."""

    def __init__(self, file: IO[str], gone: Callable[[], None]) -> None:
        self._file = file
        self._gone = gone

    def write(self, text: str) -> int:
        try:
            return self._file.write(text)
        except OSError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError:
            self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class QuietLinuxDriver(LinuxDriver):
    """LinuxDriver whose input thread costs nothing while no key is pressed, and which ends the
    app when its terminal goes away."""

    _wake: tuple[int, int] | None = None  # (read, write): a pipe per start of input
    _signals: dict[int, Any] = {}  # the handlers before ours (replaced, never changed)
    terminal_gone = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._file is not None:
            self._file = _TerminalOutput(self._file, self._on_terminal_gone)  # type: ignore[assignment]

    def _on_terminal_gone(self) -> None:
        """From any thread, once: send every write to the terminal to /dev/null and exit."""
        if self.terminal_gone:
            return
        self.terminal_gone = True
        _detach_terminal(self.fileno)
        with contextlib.suppress(RuntimeError):  # the loop has closed: the app is gone already
            self._loop.call_soon_threadsafe(self._app.exit)

    def start_application_mode(self) -> None:
        self._close_wake()
        self._wake = os.pipe()  # before the input thread starts: a quit can never miss it
        super().start_application_mode()
        # SIGHUP (the terminal closed) and SIGTERM end the app as `q` does, through its exit
        # path (a demo's trainers stopped, the terminal restored where there still is one);
        # Python's default for both ends the process on the spot and skips all of that.
        if threading.current_thread() is threading.main_thread():
            self._signals = {
                signal.SIGHUP: signal.signal(signal.SIGHUP, self._on_hangup),
                signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_terminate),
            }
        if children.stop_requested():  # a signal while Textual was imported: its interrupt
            self._on_terminate(signal.SIGTERM, None)  # may have been swallowed on the way

    def _on_hangup(self, signum: int, frame: object) -> None:
        self._on_terminal_gone()

    def _on_terminate(self, signum: int, frame: object) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._app.exit)

    def stop_application_mode(self) -> None:
        super().stop_application_mode()
        signals, self._signals = self._signals, {}
        for sig, handler in signals.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)

    def run_input_thread(self) -> None:
        if self._wake is None:
            super().run_input_thread()
        else:
            self._read_input(self._wake[0])

    def _read_input(self, wake_read: int) -> None:
        selector = selectors.SelectSelector()
        selector.register(self.fileno, selectors.EVENT_READ)
        selector.register(wake_read, selectors.EVENT_READ)
        fileno = self.fileno
        parser = XTermParser(self._debug)
        decode = getincrementaldecoder("utf-8")().decode

        def read() -> bytes:
            try:
                raw = os.read(fileno, 1024 * 4)
            except OSError as exc:
                if exc.errno in GONE_ERRNOS:
                    raise TerminalGone from None
                raise
            if not raw:  # EOF: a closed pipe, or a terminal whose other end is gone
                raise TerminalGone
            return raw

        def process(events: list[tuple[selectors.SelectorKey, int]], final: bool = False) -> None:
            ours = [event for event in events if event[0].fd == fileno]
            for number, (_key, mask) in enumerate(ours):
                if mask & selectors.EVENT_READ:
                    data = decode(read(), final=final and number == len(ours) - 1)
                    for event in parser.feed(data):
                        self.process_message(event)
            for event in parser.tick():
                self.process_message(event)

        try:
            # The wake pipe is never drained: once written, every select returns at once, so
            # the loop spins only until disable_input has set exit_event (microseconds).
            while not self.exit_event.is_set():
                process(selector.select(parser_timeout(parser)))
            selector.unregister(wake_read)
            process(selector.select(0.1), final=True)
        except TerminalGone:
            self._on_terminal_gone()  # the thread ends here: there is nothing left to read
        finally:
            selector.close()
            with contextlib.suppress(EOFError, ParseError):
                for _event in parser.feed(""):
                    pass

    def disable_input(self) -> None:
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(OSError):
                os.write(wake[1], b"x")
        super().disable_input()  # sets exit_event and joins the input thread
        self._close_wake()  # only now: the thread no longer selects on it

    def _close_wake(self) -> None:
        wake, self._wake = self._wake, None
        for fd in wake or ():
            with contextlib.suppress(OSError):
                os.close(fd)


def _detach_terminal(terminal_fd: int) -> None:
    """Point every standard descriptor that is `terminal_fd`'s terminal at /dev/null."""
    try:
        terminal = os.fstat(terminal_fd).st_rdev
    except OSError:
        terminal = None
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in {0, 1, 2, terminal_fd}:
            with contextlib.suppress(OSError):
                info = os.fstat(fd)
                if stat.S_ISCHR(info.st_mode) and (terminal is None or info.st_rdev == terminal):
                    os.dup2(null, fd)
    finally:
        os.close(null)
