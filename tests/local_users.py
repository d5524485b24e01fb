"""Real local users for the tests of root on a shared box: created by the test (useradd),
removed after it (userdel).  Only root can: the tests that need one skip otherwise."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root (and useradd) to create a second local user",
)


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int


@contextmanager
def local_user(prefix: str = "mtusr") -> Iterator[LocalUser]:
    """A throwaway user without a home; removed on the way out, whatever happened."""
    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True
    )
    try:
        entry = pwd.getpwnam(name)
        yield LocalUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False)


def as_user(
    user: LocalUser, *command: str, cwd: str = "/", env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`command` started as `user` (its uid and gid, no other group), stdout piped."""
    return subprocess.Popen(
        list(command),
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        cwd=cwd,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"} if env is None else env,
    )


def wait_ready(process: subprocess.Popen[bytes]) -> None:
    assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
