"""`python -m memtop`, and the `memtop` command: its console script imports `main` from here
(pyproject.toml's entry point), so that both hold the collector before memtop.cli's imports
(memtop.base.start_gc).  The script generated for `memtop.cli:main` imported memtop.cli first:
~17 collections before main() could hold it."""

import sys

from memtop.base import start_gc

start_gc.hold()  # before memtop.cli and its imports; main() gives it back (memtop.cli)

from memtop.base import records  # noqa: E402

records.make_records_quickly()  # the viewer's records only: never in a trainer's process

from memtop.cli import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
