"""An agent in a user-namespaced (rootless) container, read by root on the host (issue 36,
item 19): the container does not map uid 0, so the agent sees root as the overflow uid (65534)
and refuses it.  Root's viewer says so in words, not "unreachable … Broken pipe".

Real: a second local user starts a trainer's agent under `unshare --user --map-root-user` (its
uid 0 there is the user outside); root runs `memtop --once --json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from local_users import local_user, needs_root

from memtop import protocol

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

pytestmark = [
    pytest.mark.slow,
    needs_root,
    pytest.mark.skipif(
        SYSTEM_PYTHON is None
        or shutil.which("unshare") is None
        or shutil.which("setpriv") is None
        or not Path("/var/tmp").is_dir(),
        reason="needs python3, unshare, setpriv and /var/tmp",
    ),
]


def test_an_agent_that_cannot_map_root_is_explained() -> None:
    # The agent's package (standard library only) where the user can read it.
    outside = Path(tempfile.mkdtemp(prefix="mtuns-", dir="/var/tmp"))
    outside.chmod(0o755)
    shutil.copytree(ROOT / "memtop", outside / "memtop", ignore=shutil.ignore_patterns("*.pyc"))
    for path in outside.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    with local_user("mtuns") as user, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, outside, ignore_errors=True)
        sockets = protocol.socket_dir({}, user.uid)  # /tmp/memtop-<uid>, the user's
        subprocess.run(
            ["mkdir", "-m", "700", str(sockets)], user=user.uid, group=user.gid, check=True
        )
        cleanup.callback(shutil.rmtree, sockets, ignore_errors=True)
        program = (
            f"import sys, time; sys.path.append({str(outside)!r}); import memtop; "
            "memtop.start_agent(); time.sleep(1000)"
        )
        agent = subprocess.Popen(
            ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
             "unshare", "--user", "--map-root-user",
             "env", "-i", "PATH=/usr/bin:/bin", f"MEMTOP_SOCKET_DIR={sockets}",
             str(SYSTEM_PYTHON), "-c", program],
            stderr=subprocess.PIPE,
        )  # fmt: skip
        cleanup.callback(agent.wait)
        cleanup.callback(agent.kill)
        deadline = time.monotonic() + 30
        socket_file = sockets / f"{agent.pid}.sock"
        while not socket_file.exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                assert agent.stderr is not None
                pytest.skip(f"no agent in a user namespace here: {agent.stderr.read()!r}")
            time.sleep(0.1)
        xdg = Path(tempfile.mkdtemp(prefix="mtuns-xdg-"))
        cleanup.callback(shutil.rmtree, xdg, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if k != "MEMTOP_SOCKET_DIR"}
        env["XDG_RUNTIME_DIR"] = str(xdg)
        result = subprocess.run(
            [sys.executable, "-m", "memtop.cli", "--once", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd="/",
        )
    assert result.returncode == 0, result.stderr
    rows = [a for a in json.loads(result.stdout)["agents"] if a["pid"] == agent.pid]
    assert len(rows) == 1, json.loads(result.stdout)["agents"]
    (row,) = rows
    error = row["error"]
    assert "Broken pipe" not in error and "user namespace" in error, error
    assert "uid 65534, the overflow uid" in error and "does not map uid 0" in error, error
