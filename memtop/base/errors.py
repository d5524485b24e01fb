"""The one base of the errors a user is told in one line (DESIGN §7).

The command line prints any `MemtopError` as `memtop: <message>` on stderr and exits with its
`exit_code` (1, or 2 for a flag's value that cannot be used, as argparse's own usage errors):
a module that raises one needs no handler of its own between it and `memtop.cli`.
"""

from __future__ import annotations


class MemtopError(Exception):
    """Shown as one line on stderr; the process exits with `exit_code`."""

    exit_code = 1
