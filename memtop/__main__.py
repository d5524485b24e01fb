"""`python -m memtop`: the same as the `memtop` command."""

import sys

from memtop.base import start_gc

start_gc.hold()  # before memtop.cli and its imports (memtop.base.start_gc)

from memtop.cli import main  # noqa: E402

sys.exit(main())
