"""The subcommands that grew beyond argument parsing: record, replay, attach.

`memtop.cli` parses and dispatches; each module here runs one command and returns its exit code.
"""


class CommandError(Exception):
    """Shown as one line on stderr with exit code 1 (as memtop.cli's CliError)."""
