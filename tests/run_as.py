"""memtop's command line run as another local user, from an interpreter root started.

The test machine's Python lives where only root can read it (/root is 0700 there), so another
user cannot start it; this script imports what the command needs as root, then drops to the
user (groups, gid, uid: for real, no way back) and runs the command.

    python tests/run_as.py UID GID memtop-args...
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import memtop

# Everything the commands import on their way, loaded while the files are readable.
for module in pkgutil.walk_packages(memtop.__path__, "memtop."):
    skipped = (
        "memtop.ui",
        "memtop.sim",
        "memtop.agent",
        "memtop.present.report",
        "memtop.integrations",
    )
    if not module.name.startswith(skipped) and not module.name.endswith("__main__"):
        importlib.import_module(module.name)
from memtop import cli  # noqa: E402

uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
os.chdir("/")
sys.exit(cli.main(sys.argv[3:]))
