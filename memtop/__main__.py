"""`python -m memtop`: the same as the `memtop` command."""

import sys

from memtop.cli import main

sys.exit(main())
