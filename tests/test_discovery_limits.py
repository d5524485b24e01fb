"""Root's discovery on a shared box where one user makes many directories and agents (issue 36,
items 3 and 4): a directory belongs to its owner (lstat), not to the number in its name; limits
hold per owner; running out of file descriptors is one line; a flood of empty directories costs a
bounded round and one line per owner.

Run as root with a real second user (tests/local_users.py); the flood runs in a private mount
namespace with a /tmp of its own, so nobody else's memtop on the box sees it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from local_users import LocalUser, as_user, local_user, needs_root, wait_ready

from memtop import protocol
from memtop.protocol.discovery import SocketDirs, canonical_uid
from memtop.sources.agents import AgentPool

pytestmark = [pytest.mark.slow, needs_root]

ROOT = Path(__file__).resolve().parent.parent
CROWD = str(Path(__file__).with_name("agent_crowd.py"))
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
PER_DIRECTORY = 40  # two directories of one user: 80 agents, over the 64 per user


@dataclass
class Crowd:
    user: LocalUser
    canonical: Path  # /tmp/memtop-<uid>
    aliases: list[Path]  # /tmp/memtop-0<uid>, /tmp/memtop-00<uid>: the same uid by name
    xdg: Path  # root's own runtime directory (no agents)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "MEMTOP_SOCKET_DIR"}
        env["XDG_RUNTIME_DIR"] = str(self.xdg)
        return env


@pytest.fixture(scope="module")
def crowd() -> Iterator[Crowd]:
    with local_user("mtcrd") as user:
        canonical = protocol.socket_dir({}, user.uid)
        aliases = [canonical.with_name(f"memtop-0{user.uid}")]
        xdg = Path(tempfile.mkdtemp(prefix="mtcrd-xdg-"))
        made = [canonical, *aliases]
        process = None
        try:
            for path in made:
                subprocess.run(
                    ["mkdir", "-m", "700", str(path)], user=user.uid, group=user.gid, check=True
                )
            process = as_user(
                user, SYSTEM_PYTHON, CROWD, str(PER_DIRECTORY), *map(str, made),
                cwd=str(Path(CROWD).parent),
            )  # fmt: skip
            wait_ready(process)
            yield Crowd(user, canonical, aliases, xdg)
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(xdg, ignore_errors=True)


def once(crowd: Crowd, *prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "memtop.cli", "--once", "--json"],
        capture_output=True,
        text=True,
        env=crowd.env(),
        timeout=120,
    )


def crowd_rows(report: dict[str, object], crowd: Crowd) -> list[dict[str, object]]:
    """The report's rows of this crowd's agents.  Root reads every user's default socket
    directory, and a second copy of the suite run at once has its own crowd, of its own
    throwaway user, there: its 40 rows are in this report too (80 rows in both copies)."""
    agents = report["agents"]
    assert isinstance(agents, list)
    ours = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == crowd.user.uid}
    return [a for a in agents if a["argv"] == ["hostile-plain.py"] and a["pid"] in ours]


def test_a_name_is_not_an_owner() -> None:
    assert canonical_uid("1001") == 1001 and canonical_uid("0") == 0
    for alias in ("01001", "001001", "+1001", "1001 ", "١٠٠١", ""):
        assert canonical_uid(alias) is None, alias


def test_one_user_is_read_once_whatever_their_directories_are_named(crowd: Crowd) -> None:
    result = once(crowd)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = crowd_rows(report, crowd)
    # Only the directory named after its owner is read: its 40 agents, not 80 (which was more
    # than the 64 a user may have read, by naming a second directory `memtop-0<uid>`).
    assert len(rows) == PER_DIRECTORY, (len(rows), report["problems"])
    in_canonical = {int(p.name.split(".")[0]) for p in crowd.canonical.glob("*.sock")}
    assert {row["pid"] for row in rows} == in_canonical
    # ... and the other is named in one line, under its real owner.
    lines = [p for p in report["problems"] if str(crowd.aliases[0]) in p]
    assert len(lines) == 1 and f"of uid {crowd.user.uid} ignored" in lines[0], lines


def test_the_agent_limit_holds_per_owner_across_directories(crowd: Crowd) -> None:
    pool = AgentPool()
    pool.MAX_AGENTS_PER_USER = 30
    pool._finder = SocketDirs()
    try:
        directories = [(crowd.canonical, crowd.user.uid), (crowd.aliases[0], crowd.user.uid)]
        scan = pool._full_scan(directories)
        assert len(scan.found) == 30, len(scan.found)
        assert any("at most 30 agents per user" in p for p in scan.problems)
    finally:
        pool.close()


def _threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_the_exporters_threads_do_not_grow_with_agents(crowd: Crowd) -> None:
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=crowd.env(),
    )
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline().decode()
        assert "serving" in line, line
        url = line.split("serving ", 1)[1].strip()
        time.sleep(3.0)  # a few rounds: every agent connected
        threads, fds = _threads_and_fds(exporter.pid)
        # The agents it reads: this crowd's 40, and those of any other user's on the box (a
        # second copy of the suite run at once has a crowd of its own: 86 descriptors here).
        with urllib.request.urlopen(url, timeout=30) as response:
            exposition = response.read().decode()
        agents = exposition.count("\nmemtop_agent_info{")
    finally:
        exporter.terminate()
        exporter.wait(timeout=30)
    # Every agent read: a connection each, but not a thread each.
    assert agents >= PER_DIRECTORY, agents
    assert threads <= 24, threads
    assert agents <= fds <= agents + 40, (fds, agents)


@pytest.mark.parametrize("limit", [24, 48])
def test_running_out_of_file_descriptors_is_one_line(crowd: Crowd, limit: int) -> None:
    result = once(crowd, "prlimit", f"--nofile={limit}", "--")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    report = json.loads(result.stdout)
    lines = [p for p in report["problems"] if "file descriptors" in p]
    assert len(lines) == 1, report["problems"]


def test_the_exporter_under_a_small_descriptor_limit_keeps_serving(crowd: Crowd) -> None:
    exporter = subprocess.Popen(
        ["prlimit", "--nofile=48", "--", sys.executable, "-m", "memtop.cli", "export",
         "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=crowd.env(),
    )  # fmt: skip
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline().decode()
        assert "serving" in line, (line, exporter.stderr.read() if exporter.stderr else b"")
        url = line.split("serving ", 1)[1].strip()
        time.sleep(3.0)
        for _ in range(3):
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        assert exporter.poll() is None
        assert text.count('job="hostile-plain.py"') > 0
    finally:
        exporter.terminate()
        _, stderr = exporter.communicate(timeout=30)
    assert b"Traceback" not in stderr and b"Too many open files" not in stderr, stderr[-3000:]


def _flood(root: Path, count: int, owner: int) -> None:
    for n in range(1, count + 1):
        path = root / f"memtop-{n}"
        path.mkdir(mode=0o700)
        os.chown(path, owner, owner)


def test_a_flood_of_directories_is_judged_in_bounded_rounds_and_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _flood(tmp_path, 250, 4242)
    finder = SocketDirs(roots=[(tmp_path, "memtop-", "")])
    finder.MAX_CHECKS_PER_ROUND = 100
    calls = []
    real_lstat = os.lstat
    monkeypatch.setattr(
        "memtop.protocol.discovery.os.lstat", lambda p: calls.append(p) or real_lstat(p)
    )
    first = finder.scan()
    assert len(calls) == 100
    assert any("150 more entries" in p for p in first.problems), first.problems
    finder.scan(), finder.scan()
    assert len(calls) == 250
    calls.clear()
    settled = finder.scan()
    assert calls == []  # verdicts kept: nothing judged again
    (line,) = settled.problems
    assert line.startswith("250 directories of uid 4242 ignored"), line
    assert settled.dirs == []
    # One entry gone, one new: the new one is judged, that one only.
    os.rmdir(tmp_path / "memtop-7")
    (tmp_path / "memtop-251").mkdir(mode=0o700)
    after = finder.scan()
    assert [Path(p).name for p in calls] == ["memtop-251"]
    assert after.problems[0].startswith("1 directory of uid 0 ignored")
    assert after.problems[1].startswith("249 directories of uid 4242 ignored")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_ten_thousand_empty_directories_are_one_line(crowd: Crowd) -> None:
    # A private mount namespace with a /tmp of its own: the box's /tmp is not touched.
    program = (
        "import os, subprocess, sys\n"
        "for n in range(1, 10001):\n"
        "    os.mkdir(f'/tmp/memtop-{n}', 0o700); os.chown(f'/tmp/memtop-{n}', "
        f"{crowd.user.uid}, {crowd.user.gid})\n"
        "sys.exit(subprocess.run([sys.executable, '-m', 'memtop.cli', '--once', '--json'])"
        ".returncode)\n"
    )
    # The interpreter, its packages and this checkout may live under /tmp themselves (CI's venv
    # does): each is bind-mounted aside before the new /tmp hides it, and back in after.
    keep = [
        p for p in dict.fromkeys(
            os.path.realpath(q)
            for q in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), str(ROOT))
        )
        if p.startswith("/tmp/")
    ]  # fmt: skip
    aside = "".join(
        f'mkdir -p "$k/{i}" && mount --bind "{p}" "$k/{i}" && ' for i, p in enumerate(keep)
    )
    back = "".join(f'mkdir -p "{p}" && mount --bind "$k/{i}" "{p}" && ' for i, p in enumerate(keep))
    script = (
        "k=$(mktemp -d /run/mt-keep.XXXXXX) && "
        f"{aside}mount -t tmpfs -o mode=1777 tmpfs /tmp && {back}"
        'exec "$0" -c "$1"'
    )
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable,
         program],
        capture_output=True, text=True, env=crowd.env(), timeout=300,
    )  # fmt: skip
    if "unshare failed" in result.stderr or "mount:" in result.stderr:
        pytest.skip(f"no private mount namespace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr[-3000:]
    problems = json.loads(result.stdout)["problems"]
    flood = [p for p in problems if "(/tmp/memtop-" in p]
    assert len(flood) == 1, (len(problems), problems[:5])
    # /tmp/memtop-<its uid> among them is the user's own: read, not counted.
    assert flood[0].startswith(f"9,999 directories of uid {crowd.user.uid} ignored"), flood
    assert len(problems) <= 4, problems
