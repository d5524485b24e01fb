"""Test helpers shared by several test modules (a package: `from helpers import ...`)."""

import signal


def default_sigint() -> None:
    """preexec_fn for a child that a test sends Ctrl-C: a shell's background job starts with
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
