"""The input thread that sleeps until a key arrives (memtop.ui.quiet_driver): a lone Escape is
still delivered once the key parser's deadline passes, and `q` still quits at once (the wake
pipe), in a real pseudo-terminal."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_ui_cli import drain, read_until, spawn_in_pty
from textual._xterm_parser import XTermParser

from memtop.engine.store import Store
from memtop.ui.app import MemtopApp
from memtop.ui.quiet_driver import FALLBACK_TIMEOUT_S, QuietLinuxDriver, parser_timeout


def test_the_thread_sleeps_without_a_deadline_until_a_key_is_half_read() -> None:
    parser = XTermParser()
    assert parser_timeout(parser) is None  # nothing pending: sleep until input
    list(parser.feed("\x1b"))  # a lone ESC: Escape, or the start of a sequence?
    waited = parser_timeout(parser)
    assert waited is not None and 0 < waited <= 1.0
    assert parser_timeout(object()) == FALLBACK_TIMEOUT_S  # a Textual without the attribute


def test_the_dashboard_uses_it_on_linux_unless_asked_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TEXTUAL_DRIVER", raising=False)
    assert MemtopApp(Store()).get_driver_class() is QuietLinuxDriver
    monkeypatch.setenv("MEMTOP_TEXTUAL_INPUT_POLL", "1")
    assert MemtopApp(Store()).get_driver_class().__name__ == "LinuxDriver"


@pytest.mark.slow
def test_escape_alone_closes_help_and_q_quits_at_once(socket_dir: Path) -> None:
    process, master = spawn_in_pty([], socket_dir, size=(100, 30))
    try:
        read_until(master, b"Quit", timeout=30)  # the footer: the dashboard takes keys
        time.sleep(0.5)  # the input thread is now asleep in select, no deadline
        os.write(master, b"?")
        read_until(master, b"memtop help", timeout=10)
        os.write(master, b"\x1b")  # Escape alone: only the parser's deadline turns it into a key
        # Help is gone and the page under it is drawn again (the empty page, or on a box with
        # GPUs the dashboard).
        after = b""
        while b"No GPUs" not in after and b"Processes" not in after:
            after += read_until(master, b"\x1b[", timeout=10)
        started = time.monotonic()
        os.write(master, b"q")
        assert drain(master, process) == 0
        assert time.monotonic() - started < 5.0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
