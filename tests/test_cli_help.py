"""The command line's help is a contract (DESIGN §7): every command's `--help`, the usage
errors, a few one-line errors and `--version`, pinned word for word in tests/data/cli-help.txt.

A change to a flag or its help shows here as a diff.  After a deliberate one, write the file
anew with MEMTOP_REGEN_HELP=1 and read the diff before committing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memtop import cli
from memtop._version import __version__

PINNED = Path(__file__).parent / "data" / "cli-help.txt"
COMMANDS = [
    (),
    ("demo",),
    ("cleanup",),
    ("snapshot",),
    ("run",),
    ("attach",),
    ("record",),
    ("replay",),
    ("estimate",),
    ("oom",),
    ("export",),
    ("report",),
    ("compare",),
]
USAGE_ERRORS = [
    ("--bogus",),
    ("--json",),
    ("demo", "--scenario", "nope"),
    ("--interval", "0"),
    ("run",),
    ("cleanup",),
    ("snapshot", "1"),
    ("--only", "x"),
]
# One-line errors (exit 1) that need no GPU, agent or network.
ERRORS = [
    ("cleanup", "1", "--wait", "-1"),
    ("snapshot", "1", "-o", "x.pickle", "--wait", "-1"),
    ("record", "-o", "/nonexistent-memtop-dir/x"),
    ("record", "-o", "x", "--seconds", "0"),
    ("replay", "x", "--json"),
    ("replay", "/nonexistent-memtop-dir/x", "--once"),
    ("attach", "1", "--wait", "0"),
    ("oom", "/nonexistent-memtop-dir/x"),
    ("--prometheus", "http://127.0.0.1:9", "--only", "0"),
    ("report", "/nonexistent-memtop-dir/x"),
    ("compare", "/nonexistent-memtop-dir/x", "/nonexistent-memtop-dir/y"),
]


def _call(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return f"$ memtop {' '.join(argv)}\n[exit {code}]\n[stdout]\n{out}[stderr]\n{err}\n"


def test_every_help_and_usage_error_is_as_pinned(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    monkeypatch.setenv("LINES", "40")
    parts = [_call((*command, "--help"), capsys) for command in COMMANDS]
    parts += [_call(argv, capsys) for argv in USAGE_ERRORS]
    parts += [_call(argv, capsys) for argv in ERRORS]
    parts.append(_call(("--version",), capsys))
    # The version is the release's, not part of the contract: pinned as a placeholder.
    text = "".join(parts).replace(f"memtop {__version__}\n", "memtop VERSION\n")
    if os.environ.get("MEMTOP_REGEN_HELP"):
        PINNED.write_text(text)
    assert text == PINNED.read_text()
