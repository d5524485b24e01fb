"""Which users' socket directories root's viewer reads (issue 36, items 3 and 4).

Root reads every user's `/tmp/memtop-<uid>` and `/run/user/<uid>/memtop`.  Anyone may make
directories in /tmp, under any name, so a name proves nothing:

- a directory belongs to its owner as `lstat` says, never to the number in its name; one whose
  number is not its owner's uid written the way memtop writes it (`memtop-01001`, `memtop-5` made
  by uid 1001) is not read, and is counted under its real owner.  So each user has at most one
  directory in /tmp and one under /run/user, and limits per user hold per owner;
- entries are judged once: a verdict is kept by (name, inode), which a listing gives without a
  system call each, and checked again every REVERIFY_S; the listing itself is read again only
  when /tmp's own version (inode, mtime) changed;
- at most MAX_CHECKS_PER_ROUND entries are judged per round (a flood costs a bounded round; the
  rest wait for the next, and a line says so);
- what is not read is said in one line per owner ("10000 directories of uid 1001 ignored: …").
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from memtop.base.records import record
from memtop.protocol.text import decimal

# Where root looks: (the directory listed, the prefix of an entry's name, the path under it).
TMP_ROOT = (Path("/tmp"), "memtop-", "")
RUN_USER_ROOT = (Path("/run/user"), "", "memtop")


@record(frozen=True, slots=True)
class _Verdict:
    """Whether a socket directory's entry was accepted, as judged from its owner at
    `judged_at`."""

    path: Path  # the socket directory this entry stands for
    owner: int | None  # its owner as lstat says (None: nothing there)
    accepted: bool  # read (its name is its owner's uid, written as memtop writes it)
    judged_at: float


@dataclass
class _Root:
    """A directory where root looks for users' socket directories (TMP_ROOT, RUN_USER_ROOT),
    and the entries last listed there."""

    directory: Path
    prefix: str
    below: str
    version: tuple[int, int, int] | None = None
    entries: list[tuple[str, int]] = field(default_factory=list)  # (name, inode)


@record(frozen=True, slots=True)
class Discovery:
    """The socket directories to read (each with the uid that owns it) and, one line each, what
    was not read and why."""

    dirs: list[tuple[Path, int]]
    problems: list[str]


def canonical_uid(text: str) -> int | None:
    """The uid a directory name's number stands for, when written as memtop writes it (ASCII
    digits, no leading zero): `01001` and `+1001` stand for nothing."""
    uid = decimal(text)
    return uid if uid is not None and str(uid) == text else None


class SocketDirs:
    """Every user's socket directory as root finds it, round after round, at a bounded cost."""

    MAX_CHECKS_PER_ROUND = 16384
    # An entry removed and made again under the same name can get the same inode number back:
    # its verdict is judged again at most this long after.
    REVERIFY_S = 30.0
    EXAMPLES = 3  # names shown per owner in the summary line

    def __init__(
        self,
        roots: Iterable[tuple[Path, str, str]] = (TMP_ROOT, RUN_USER_ROOT),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._roots = [_Root(directory, prefix, below) for directory, prefix, below in roots]
        self._verdicts: dict[tuple[Path, str, int], _Verdict] = {}
        self._clock = clock
        # The last answer: (what it was read from, until when it holds, the answer).
        self._last: tuple[object, float, Discovery] | None = None

    def scan(self, own: tuple[Path, int] | None = None, limit: int | None = None) -> Discovery:
        """One round: the directories to read now (`own`: the viewer's own, always read).
        `limit`: entries judged this round (default MAX_CHECKS_PER_ROUND; 0: no limit, for a
        one-off look)."""
        budget = self.MAX_CHECKS_PER_ROUND if limit is None else limit or -1
        now = self._clock()
        for root in self._roots:
            self._list(root)
        # Nothing listed changed and no verdict is due again: the last round's answer (a round
        # then costs one stat per root, however many entries a flood left there).
        versions = (own, tuple(root.version for root in self._roots))
        last = self._last
        if last is not None and last[0] == versions and now < last[1]:
            return last[2]
        found: dict[Path, int] = {}
        if own is not None:
            found[own[0]] = own[1]
        ignored: dict[int, list[str]] = {}
        waiting = 0
        live: set[tuple[Path, str, int]] = set()
        for root in self._roots:
            for name, inode in root.entries:
                key = (root.directory, name, inode)
                live.add(key)
                verdict = self._verdicts.get(key)
                if verdict is None or now - verdict.judged_at >= self.REVERIFY_S:
                    if budget == 0:
                        if verdict is None:
                            waiting += 1
                            continue
                    else:
                        budget -= 1
                        verdict = self._verdicts[key] = self._judge(root, name, now)
                if verdict.owner is None:
                    continue
                if verdict.accepted:
                    found.setdefault(verdict.path, verdict.owner)
                else:
                    ignored.setdefault(verdict.owner, []).append(str(verdict.path))
        for key in [key for key in self._verdicts if key not in live]:
            del self._verdicts[key]  # gone (or replaced: another inode)
        problems = [self._summary(owner, paths) for owner, paths in sorted(ignored.items())]
        if waiting:
            problems.append(
                f"{waiting} more entries named like socket directories not checked yet "
                f"(at most {self.MAX_CHECKS_PER_ROUND} a round)"
            )
        discovery = Discovery(sorted(found.items()), problems)
        due = min((v.judged_at for v in self._verdicts.values()), default=now) + self.REVERIFY_S
        self._last = (versions, now if waiting else due, discovery)
        return discovery

    def _list(self, root: _Root) -> None:
        """The entries of `root` that could be socket directories, read again only when the
        directory changed (any entry made, removed or renamed changes its mtime)."""
        try:
            info = os.stat(root.directory)
        except OSError:
            root.version, root.entries = None, []
            return
        version = (info.st_dev, info.st_ino, info.st_mtime_ns)
        if version == root.version:
            return
        entries: list[tuple[str, int]] = []
        try:
            with os.scandir(root.directory) as listing:
                for entry in listing:
                    name = entry.name
                    number = name[len(root.prefix) :]
                    if name.startswith(root.prefix) and decimal(number) is not None:
                        entries.append((name, entry.inode()))
        except OSError:
            root.version, root.entries = None, []
            return
        entries.sort()
        root.version, root.entries = version, entries

    def _judge(self, root: _Root, name: str, now: float) -> _Verdict:
        entry = root.directory / name
        path = entry / root.below if root.below else entry
        try:
            owner = os.lstat(path).st_uid
            if root.below:  # /run/user/<uid>/memtop: <uid> itself must be that user's
                parent = os.lstat(entry)
                if not stat.S_ISDIR(parent.st_mode) or parent.st_uid not in (owner, 0):
                    return _Verdict(path, owner, False, now)
        except OSError:
            return _Verdict(path, None, False, now)
        accepted = canonical_uid(name[len(root.prefix) :]) == owner
        return _Verdict(path, owner, accepted, now)

    def _summary(self, owner: int, paths: list[str]) -> str:
        shown = ", ".join(sorted(paths)[: self.EXAMPLES])
        more = ", …" if len(paths) > self.EXAMPLES else ""
        what = "directory" if len(paths) == 1 else "directories"
        return (
            f"{len(paths):,} {what} of uid {owner} ignored: named after a uid that is not their "
            f"owner's ({shown}{more}); memtop reads /tmp/memtop-<uid> of its owner only"
        )


def canonical_dirs(uid: int) -> list[Path]:
    """Where the agents of `uid` can listen, as root looks for them: `/tmp/memtop-<uid>` and
    `/run/user/<uid>/memtop` (whether they exist, and whose they are, is checked on use)."""
    return [TMP_ROOT[0] / f"{TMP_ROOT[1]}{uid}", RUN_USER_ROOT[0] / str(uid) / RUN_USER_ROOT[2]]
