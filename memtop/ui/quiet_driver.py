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
"""

from __future__ import annotations

import contextlib
import os
import selectors
from codecs import getincrementaldecoder

from textual._parser import ParseError
from textual._time import get_time
from textual._xterm_parser import XTermParser
from textual.drivers.linux_driver import LinuxDriver

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


class QuietLinuxDriver(LinuxDriver):
    """LinuxDriver whose input thread costs nothing while no key is pressed."""

    _wake: tuple[int, int] | None = None  # (read, write): a pipe per start of input

    def start_application_mode(self) -> None:
        self._close_wake()
        self._wake = os.pipe()  # before the input thread starts: a quit can never miss it
        super().start_application_mode()

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

        def process(events: list[tuple[selectors.SelectorKey, int]], final: bool = False) -> None:
            ours = [event for event in events if event[0].fd == fileno]
            for number, (_key, mask) in enumerate(ours):
                if mask & selectors.EVENT_READ:
                    data = decode(
                        os.read(fileno, 1024 * 4), final=final and number == len(ours) - 1
                    )
                    if not data:
                        break  # stdin is a pipe that was closed
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
