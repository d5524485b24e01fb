"""The trainer's own host (CPU) memory, as the kernel counts it: no torch, no CUDA, no allocator.

torch 2.13 keeps no counters for CPU tensors, so a trainer without a CUDA device has no
"allocated" or "peak" to report.  What the kernel keeps for the process is the next best figure,
and it costs a read of a /proc file:

- `VmRSS` / `VmHWM` from /proc/self/status (one read per `sample`, 14 µs of CPU on the agent's
  thread, so the two are consistent: RSS <= its high-water mark).  VmHWM is the kernel's exact
  high-water mark of the resident set since the process started, counted at every page fault:
  no sampling rate misses a step's peak.  That is why the estimate calibrates on it, not on
  the largest RSS the agent happened to see: on examples/train_cpu.py at batch 2048, RSS read
  at step boundaries stayed 6 MB under the peak (activations freed by then), while a 5 kHz
  reading thread and VmHWM agreed within 0.2 MB.  It is the host's counterpart of torch's
  `allocated_bytes.all.peak` (since the start, never reset by memtop): the agent never writes
  /proc/self/clear_refs, which would reset the VmHWM (and ru_maxrss) that /usr/bin/time and
  schedulers read.
- `rss_bytes` from /proc/self/statm at each step mark, on the trainer's thread (3 µs of CPU,
  and at most MARK_MIN_INTERVAL_S apart): the resident set right after a step, the host's baseline.
  glibc keeps freed memory in its heap (memtop never calls malloc_trim: the trainer's heap is
  not ours), so this baseline includes what the previous step freed and glibc kept.
- glibc's free bytes (`mallinfo2().fordblks`) at a step mark, at most once a second, on the
  trainer's thread (2 µs of CPU in the example trainer; glibc walks its free lists under each
  arena's lock, so the cost grows with a fragmented heap and it never runs from the agent's
  thread, where it would hold up the trainer's mallocs): the resident set minus
  them is what the process holds right after a step, without what glibc kept of the step's
  freed tensors.  Measured on examples/train_cpu.py (width 256), that difference stayed within
  333.0-333.9 MiB at batches 4 to 4096 while the resident set after a step ranged 333.8-382.3:
  it is the part that does not grow with the batch, where the resident set alone would have
  counted half of the step's activations as fixed (a batch 1024 → 2048 prediction 21 % short
  of the activations' growth, 1.3 % of the peak).  mallinfo2 only reads; memtop never calls
  malloc_trim or anything that changes the trainer's heap.  None without glibc 2.33+ (musl,
  macOS) or under another malloc (jemalloc: glibc's heap is then empty, and the estimate falls
  back on the resident set alone).

Linux only: elsewhere every reading is None and `sample` carries no `host_memory` block.  Never
raises: a reading that fails is None.  The files stay open (a read is then one pread), and a
forked child opens its own, so it never reads its parent's.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

STATUS_READ_BYTES = 8192  # /proc/self/status is ~1.5 KB; VmHWM is in its first 600 bytes
STATM_READ_BYTES = 256
MEMINFO_READ_BYTES = 256  # MemTotal is meminfo's first line


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc 2.33+): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Any:
    """glibc's mallinfo2, or None (not glibc, or older than 2.33)."""
    try:
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _Mallinfo2
    function.argtypes = []
    return function


def _read(path: str, limit: int) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _kib_field(text: bytes, name: bytes) -> int | None:
    """`Name:   1234 kB` on a line of a /proc file, in bytes; None when it is not there."""
    key = name + b":"
    if text.startswith(key):
        start = 0
    else:
        start = text.find(b"\n" + key) + 1
        if start == 0:
            return None
    end = text.find(b"\n", start)
    fields = text[start + len(key) : end if end >= 0 else len(text)].split()
    if len(fields) != 2 or fields[1] != b"kB" or not fields[0].isdigit():
        return None
    return int(fields[0]) * 1024


class _ProcFile:
    """A file of /proc/self kept open and read from its start (pread: 7 µs wall for statm where
    an open, read and close took 35).  Reopened in a forked child, whose "self" is not ours."""

    def __init__(self, path: str, limit: int) -> None:
        self.path = path
        self.limit = limit
        self._fd: int | None = None
        self._pid = 0

    def read(self) -> bytes | None:
        try:
            pid = os.getpid()
            if self._fd is None or pid != self._pid:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                self._fd, self._pid = fd, pid  # the parent's fd stays open in its own process
            return os.pread(self._fd, self.limit, 0)
        except OSError:
            return None


class HostMemory:
    """Readings of this process's resident memory.  Any thread; O(1); never raises."""

    def __init__(self) -> None:
        try:
            self.page_bytes = os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            self.page_bytes = 4096
        meminfo = _read("/proc/meminfo", MEMINFO_READ_BYTES)
        self.total_bytes = _kib_field(meminfo, b"MemTotal") if meminfo else None
        self._mallinfo2 = _mallinfo2()
        self._statm = _ProcFile("/proc/self/statm", STATM_READ_BYTES)
        self._status = _ProcFile("/proc/self/status", STATUS_READ_BYTES)

    def heap_free_bytes(self) -> int | None:
        """Bytes glibc holds free in its heaps (fordblks): resident, but no longer in use.
        Trainer's thread only (it takes glibc's arena locks); 2 µs of CPU in a small trainer."""
        if self._mallinfo2 is None:
            return None
        try:
            return int(self._mallinfo2().fordblks)
        except Exception:
            return None

    def rss_bytes(self) -> int | None:
        """The resident set now (statm's second field, in pages)."""
        text = self._statm.read()
        if text is None:
            return None
        fields = text.split()
        if len(fields) < 2 or not fields[1].isdigit():
            return None
        return int(fields[1]) * self.page_bytes

    def reading(self) -> dict[str, Any] | None:
        """The `sample` reply's `host_memory` block: {"rss_bytes", "peak_rss_bytes", "total_bytes"}
        (VmRSS and VmHWM from one read of /proc/self/status, MemTotal); None off Linux."""
        text = self._status.read()
        if text is None:
            return None
        rss = _kib_field(text, b"VmRSS")
        peak = _kib_field(text, b"VmHWM")
        if rss is None or peak is None:
            return None
        return {"rss_bytes": rss, "peak_rss_bytes": max(peak, rss), "total_bytes": self.total_bytes}
