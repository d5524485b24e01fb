"""Files the agent writes for a viewer (snapshots, later OOM reports), written so that nobody
else on the machine can turn them against the trainer's user (DESIGN §6).

The agent runs as the trainer's user and is told a path by a viewer, possibly root's.  Another
local user must not be able to (a) plant a symlink at the temp name or the target so that the
trainer overwrites a file the link points at, (b) pre-create the temp file to read the data,
(c) get a device node, FIFO or directory replaced.  So:
- the target is checked with lstat: it must not exist (unless `overwrite`), and if it exists it
  must be a regular file; its directory must be writable by this user;
- the data goes to a random temp name in the same directory, created with
  O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, fsync'd;
- without `overwrite` it is published with link(2), which fails atomically if anything appeared
  at the target meanwhile; with `overwrite` with rename(2), which replaces a directory entry and
  never follows a symlink planted at the target;
- the temp file is removed on every path out.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat


class UnsafeTarget(Exception):
    """The path given cannot be written safely; the message is one line for the viewer."""


def write_private_file(path: str, data: bytes, overwrite: bool = False) -> int:
    """Write `data` to the absolute `path` as a new 0600 file; return the bytes written."""
    if not os.path.isabs(path):
        raise UnsafeTarget(f"{path!r} is not an absolute path")
    directory, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise UnsafeTarget(f"{path!r} names a directory, not a file")
    check_target(path, overwrite)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafeTarget(f"cannot open directory {directory}: {exc.strerror}") from None
    try:
        if not os.access(directory, os.W_OK, effective_ids=True):
            raise UnsafeTarget(f"directory {directory} is not writable by uid {os.geteuid()}")
        temp = f".{name}.memtop-{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(
                temp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
        except OSError as exc:
            raise UnsafeTarget(f"cannot create a file in {directory}: {exc.strerror}") from None
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            _publish(temp, name, dir_fd, path, overwrite)
            with contextlib.suppress(OSError):
                os.fsync(dir_fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return len(data)


def check_target(path: str, overwrite: bool) -> None:
    """Refuse a target that is not a regular file, or that exists unless `overwrite`."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafeTarget(f"cannot inspect {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeTarget(f"{path} is a symbolic link; refusing to write through it")
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeTarget(f"{path} exists and is not a regular file")
    if not overwrite:
        raise UnsafeTarget(f"{path} exists; pass --force to replace it")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _publish(temp: str, name: str, dir_fd: int, path: str, overwrite: bool) -> None:
    if overwrite:
        check_target(path, overwrite=True)  # still a regular file (or gone), not a link
        try:
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            raise UnsafeTarget(f"cannot replace {path}: {exc.strerror}") from None
        return
    try:
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise UnsafeTarget(f"{path} appeared while writing; pass --force to replace it") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
            raise UnsafeTarget(f"cannot create {path}: {exc.strerror}") from None
        # A filesystem without hard links (vfat, some FUSE mounts): re-check, then rename.
        # The window between the two is the one race left, and only on such filesystems.
        check_target(path, overwrite=False)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
