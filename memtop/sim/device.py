"""Simulated GPUs: the device memory the simulated caching allocator reserves its segments from.

`LocalDeviceMemory` is one process alone on a device.  `SharedDeviceMemory` is a device shared by
several processes (the trainers `memtop demo` starts): each process's usage lives in one small
JSON ledger, so one trainer's reservation shrinks what the others (and a memtop viewer playing
NVML) see as free — the way cudaMalloc in one process makes cudaMemGetInfo smaller in another.
`SimGpuRegistry` is the directory where those processes agree on which GPUs exist.

Pure Python, no torch, no numpy: the memtop process imports this for its simulated NVML view.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from memtop.base.records import record
from memtop.protocol import namespaces, pid_alive

__all__ = [
    "DeviceMemory",
    "LedgerReader",
    "LocalDeviceMemory",
    "SharedDeviceMemory",
    "SimGpuRegistry",
    "SimGpuSpec",
    "publish_so_far",
    "published_once",
    "read_ledger",
    "simulated_gpu_specs",
]


@runtime_checkable
class DeviceMemory(Protocol):
    """What the allocator needs from "the GPU": cudaMalloc, cudaFree and cudaMemGetInfo.

    Implementations may also offer `pid: int` and `usage_by_pid() -> dict[int, int]`; the
    allocator then lists per-process usage in its OOM message the way torch does through NVML.
    """

    total_bytes: int

    def try_reserve(self, nbytes: int) -> bool: ...

    def release(self, nbytes: int) -> None: ...

    def free_bytes(self) -> int: ...


def _check_nbytes(nbytes: int) -> int:
    if nbytes < 0:
        raise ValueError(f"byte count must be >= 0, got {nbytes}")
    return int(nbytes)


class LocalDeviceMemory:
    """A device used by this process alone.

    `overhead_bytes` stands for memory that is in use but not PyTorch's (CUDA context, cuBLAS
    workspaces), so that free + reserved < total as on a real GPU.
    """

    def __init__(self, total_bytes: int, overhead_bytes: int = 0) -> None:
        if total_bytes <= 0:
            raise ValueError(f"total_bytes must be > 0, got {total_bytes}")
        self.total_bytes = int(total_bytes)
        self.overhead_bytes = _check_nbytes(overhead_bytes)
        self.pid = os.getpid()
        self._reserved = 0
        # Several allocators (one per stream pool or test) may share one device object.
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._reserved + self.overhead_bytes

    def try_reserve(self, nbytes: int) -> bool:
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            if self._reserved + self.overhead_bytes + nbytes > self.total_bytes:
                return False
            self._reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            if nbytes > self._reserved:
                raise ValueError(f"releasing {nbytes} bytes but only {self._reserved} reserved")
            self._reserved -= nbytes

    def free_bytes(self) -> int:
        with self._lock:
            return max(0, self.total_bytes - self._reserved - self.overhead_bytes)

    def usage_by_pid(self) -> dict[int, int]:
        with self._lock:
            return {self.pid: self._reserved + self.overhead_bytes}


# --------------------------------------------------------------------------------------------
# The shared ledger


# Ledger keys: "<pid>" for a process of the host's pid namespace, "<pid>.ns<inode>" for one in
# a container (its pid as it sees itself): the simulated driver, like the real one, then lists
# each process under the pid the READER sees (see protocol.namespaces).


def ledger_key(pid: int) -> str:
    """The ledger key of `pid`, a process of this process's pid namespace."""
    return namespaces.socket_name(pid, namespaces.own_pid_namespace()).removesuffix(".sock")


def _key_parts(key: str) -> tuple[int, int | None] | None:
    return namespaces.parse_socket_name(key + ".sock")


_OWN_NAMESPACE_UNREAD = -1  # visible_pid's `own` when its caller did not read it


def visible_pid(key: str, own: int | None = _OWN_NAMESPACE_UNREAD) -> int | None:
    """The pid this process sees for the ledger entry `key` (None: not visible from here).
    `own`: this process's pid namespace (namespaces.own_pid_namespace), read once by a caller
    asking of many keys (a stat of /proc/self/ns/pid each)."""
    parts = _key_parts(key)
    if parts is None:
        return None
    pid, namespace = parts
    if own == _OWN_NAMESPACE_UNREAD:
        own = namespaces.own_pid_namespace()
    here = namespace == own or (namespace is None and own in (None, namespaces.INIT_PID_NAMESPACE))
    if here:
        return pid
    if namespace is None:
        return None  # a host process, seen from inside a container
    return namespaces.find_pid(namespace, pid)


def _entry_alive(key: str) -> bool:
    """Whether the process of a ledger entry still runs; an entry this process cannot judge
    (a host process, seen from a container) is kept."""
    parts = _key_parts(key)
    if parts is None:
        return False
    seen = visible_pid(key)
    if seen is not None:
        return pid_alive(seen)
    own = namespaces.own_pid_namespace()
    return parts[1] is None and own not in (None, namespaces.INIT_PID_NAMESPACE)


def _parse_ledger(text: str | bytes) -> dict[str, int]:
    try:
        raw = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, int] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or _key_parts(key) is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            continue
        out[key] = value
    return out


def _by_visible_pid(
    ledger: dict[str, int], own: int | None = _OWN_NAMESPACE_UNREAD
) -> dict[int, int]:
    """The ledger's entries by the pid this process sees (`own`: as visible_pid's)."""
    if own == _OWN_NAMESPACE_UNREAD and ledger:
        own = namespaces.own_pid_namespace()  # read once for all the keys
    out: dict[int, int] = {}
    for key, used in ledger.items():
        seen = visible_pid(key, own)
        if seen is not None:
            out[seen] = used
    return out


LEDGER_MAX_BYTES = 1 << 20  # a ledger holds one small entry per process


def _read_ledger_file(path: Path | str) -> dict[str, int]:
    return _parse_ledger(_ledger_bytes(path))  # bytes that are not UTF-8 JSON read as empty


def _ledger_bytes(path: Path | str) -> bytes:
    """A ledger's bytes (b"": missing or unreadable, which parses as an empty ledger)."""
    # os.open/read: a viewer reads every simulated GPU's ledger every second, and a buffered
    # text file object costs more than the read itself.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, LEDGER_MAX_BYTES)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    # A reader that takes no lock (a viewer on a read-only mount) must never see half a file.
    # The temporary file is named for this process and thread (mkstemp's random name and its
    # buffered file object were a third of a ledger write's CPU): made new, never through a
    # symlink; one a killed writer left behind is removed first.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)
    try:
        try:
            data = memoryview(text.encode())
            # The file's blocks allocated before it is written: on ext4 a rename over the old
            # ledger first flushes a new file's delayed-allocation blocks (auto_da_alloc), ~a
            # third of a write's CPU, and a preallocated file has none (tmpfs: the same cost).
            with contextlib.suppress(OSError):  # a file system without it: written as before
                os.posix_fallocate(fd, 0, len(data))
            while data:  # a regular file takes it whole, barring a full disk
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _flocked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold flock on `path`'s companion lock file.

    The lock lives in a separate file because the ledger itself is replaced on every write,
    and a lock on a replaced inode protects nothing.  Readers that cannot create the lock file
    go on unlocked: writes are atomic renames, so they still see a whole ledger.
    """
    lock_path = path.with_name(path.name + ".lock")
    lock_file: IO[bytes] | None
    try:
        lock_file = open(lock_path, "a+b")  # noqa: SIM115 - closed in finally
    except OSError:
        if exclusive:
            raise
        lock_file = None
    try:
        if lock_file is not None:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if lock_file is not None:
            lock_file.close()  # closing drops the flock


def read_ledger(path: Path, live_only: bool = True, locked: bool = True) -> dict[int, int]:
    """{pid: used bytes} of a device ledger; entries of dead pids left out unless asked for.

    Missing or corrupt ledgers read as empty: a viewer must not crash on a half-set-up demo.
    `locked=False` reads without the shared lock: every write is an atomic rename, so the
    ledger read is always a whole one (a viewer reading every GPU every second saves an open
    and a flock per GPU).
    """
    path = Path(path)
    if not locked:
        ledger = _read_ledger_file(path)  # a missing ledger reads as empty
    elif not path.exists():
        return {}  # and leave no lock file behind for a GPU that does not exist
    else:
        with _flocked(path, exclusive=False):
            ledger = _read_ledger_file(path)
    pids = _by_visible_pid(ledger)
    if live_only:
        pids = {pid: used for pid, used in pids.items() if pid_alive(pid)}
    return pids


class LedgerReader:
    """A viewer's reads of device ledgers, every simulated GPU every second: what
    `read_ledger(path, locked=False)` returns, for many ledgers at a time (`usage`).

    Each ledger is read whole every time (an open and a read), and parsed again only when its
    bytes differ from this reader's last read of it: the same bytes are the same ledger, so
    nothing is guessed (a steady demo's ledgers change a few times a minute; their JSON and
    the checks of their keys were most of a read).  Whether each entry's process still runs is
    asked at every `usage`, once per pid however many GPUs it is on: a trainer that died
    leaves its entry behind, and NVML lists no dead process."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[bytes, dict[str, int]]] = {}  # path -> (bytes, ledger)

    def usage(self, paths: Sequence[str]) -> list[list[tuple[int, int]]]:
        """For each ledger of `paths`: (pid as seen here, used bytes) of its live processes,
        by pid (a missing or unreadable ledger: none)."""
        own = namespaces.own_pid_namespace()
        alive: dict[int, bool] = {}
        parsed: dict[str, tuple[bytes, dict[str, int]]] = {}
        usages = []
        for path in paths:
            data = _ledger_bytes(path)
            known = self._parsed.get(path)
            if known is None or known[0] != data:
                known = (data, _parse_ledger(data))
            parsed[path] = known
            by_pid = _by_visible_pid(known[1], own)
            for pid in by_pid:
                if pid not in alive:
                    alive[pid] = pid_alive(pid)
            usages.append(sorted((pid, used) for pid, used in by_pid.items() if alive[pid]))
        self._parsed = parsed  # the ledgers asked this time only (a demo gone: forgotten)
        return usages


class SharedDeviceMemory:
    """A simulated GPU shared by several processes through a JSON ledger {"<pid>": used_bytes}.

    free = total - sum(used of live pids).  This process's entry is its reserved segments plus
    `overhead_bytes`; this object is the authority on it, the ledger only publishes it.  Use one
    object per (process, GPU): two objects with the same pid would overwrite each other's entry.
    """

    def __init__(
        self,
        ledger_path: Path,
        total_bytes: int,
        pid: int | None = None,
        overhead_bytes: int = 0,
    ) -> None:
        if total_bytes <= 0:
            raise ValueError(f"total_bytes must be > 0, got {total_bytes}")
        self.ledger_path = Path(ledger_path)
        self.total_bytes = int(total_bytes)
        self.pid = os.getpid() if pid is None else int(pid)
        self._key = ledger_key(self.pid)
        self.overhead_bytes = _check_nbytes(overhead_bytes)
        self._reserved = 0
        self._closed = False
        # Reentrant: a batch holds it from its first reserve or release to its publish, and the
        # reserves and releases after that take it again.
        self._lock = threading.RLock()
        self._one_batch = threading.Lock()  # held by the thread inside batch()
        self._batch_thread: int | None = None  # that thread
        # What a batch took at its first reserve or release and holds until it publishes: the
        # object's lock and the ledger's exclusive lock (to let go of), and the ledger it read.
        self._batch_held: contextlib.ExitStack | None = None
        self._batch_ledger: dict[str, int] | None = None
        self._batch_changed = False  # a reserve or release since the batch's last publish
        with self._lock, self._ledger(exclusive=True) as ledger:
            self._publish(ledger)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The reserves and releases made inside, on this thread, published as one write (at
        the end, or at each publish_batch()).

        A trainer's model and its optimizer state are a few hundred segments reserved in a
        row, and its first step a few hundred more, a layer's at a time; each publish (a lock,
        a read, a temporary file and a rename: ~0.1-0.3 ms of CPU on ext4) was most of a
        simulated trainer's start.  From the batch's first reserve or release to its publish
        the exclusive lock is held: another process reserves before or after, never against a
        ledger that lacks what this one reserved (other threads of this one wait on the
        object's lock).  So whenever a viewer reads the ledger, it reads the whole GPU as it
        was at one instant (the last publish), which a real GPU showed then.  A batch in which
        nothing is reserved or released takes no lock and writes nothing (a steady trainer's
        step).  Nested: the outermost one publishes."""
        if self._batch_thread == threading.get_ident():
            yield
            return
        # One batch at a time: another thread's waits for this one to end (take it before any
        # lock a reserve inside would take, as the allocator does: its lock comes after).
        with self._one_batch:
            self._batch_thread = threading.get_ident()
            try:
                yield
            finally:
                try:
                    self.publish_batch()
                finally:
                    self._batch_thread = None

    def publish_batch(self) -> None:
        """Inside batch(), on its thread: publish what it reserved and released so far and let
        go of the ledger's lock, as at its end; the batch goes on.  A trainer calls this before
        it waits (other processes then reserve meanwhile, and a viewer sees its state as of the
        pause).  Elsewhere: nothing."""
        if self._batch_thread != threading.get_ident() or self._batch_held is None:
            return
        held, ledger, changed = self._batch_held, self._batch_ledger, self._batch_changed
        self._batch_held, self._batch_ledger, self._batch_changed = None, None, False
        with held:
            if changed and ledger is not None:
                self._publish(ledger)

    # -- ledger plumbing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _ledger(self, exclusive: bool) -> Iterator[dict[str, int]]:
        if self._batch_thread == threading.get_ident():
            # Inside batch(), on its thread: the first use takes the object's lock and the
            # ledger's exclusive lock until the batch publishes, and the ledger read then is the
            # ledger, since no other process can write it meanwhile.
            if self._batch_held is None:
                with contextlib.ExitStack() as held:
                    held.enter_context(self._lock)
                    held.enter_context(_flocked(self.ledger_path, exclusive=True))
                    self._batch_ledger = _read_ledger_file(self.ledger_path)
                    self._batch_held = held.pop_all()
            assert self._batch_ledger is not None
            yield self._batch_ledger
            return
        with _flocked(self.ledger_path, exclusive):
            yield _read_ledger_file(self.ledger_path)

    def _others(self, ledger: dict[str, int]) -> dict[str, int]:
        return {key: used for key, used in ledger.items() if key != self._key and _entry_alive(key)}

    def _publish(self, ledger: dict[str, int]) -> None:
        """Rewrite the ledger with this process's current entry and without dead pids.

        Called with the exclusive lock held; inside batch(), when it publishes."""
        if self._batch_thread == threading.get_ident() and self._batch_held is not None:
            self._batch_changed = True  # published by the batch
            return
        out = self._others(ledger)
        if not self._closed:
            out[self._key] = self._mine()
        text = json.dumps(dict(sorted(out.items())))
        _write_atomically(self.ledger_path, text)

    def _mine(self) -> int:
        return self._reserved + self.overhead_bytes

    # -- DeviceMemory --------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """This process's usage (what NVML would list for it)."""
        return self._mine()

    def try_reserve(self, nbytes: int) -> bool:
        nbytes = _check_nbytes(nbytes)
        with self._lock, self._ledger(exclusive=True) as ledger:
            others = sum(self._others(ledger).values())
            if others + self._mine() + nbytes > self.total_bytes:
                return False
            self._reserved += nbytes
            self._closed = False
            self._publish(ledger)
            return True

    def release(self, nbytes: int) -> None:
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            if nbytes > self._reserved:
                raise ValueError(f"releasing {nbytes} bytes but only {self._reserved} reserved")
            with self._ledger(exclusive=True) as ledger:
                self._reserved -= nbytes
                self._publish(ledger)

    def free_bytes(self) -> int:
        with self._lock, self._ledger(exclusive=False) as ledger:
            used = sum(self._others(ledger).values()) + (0 if self._closed else self._mine())
        return max(0, self.total_bytes - used)

    def usage_by_pid(self) -> dict[int, int]:
        """{pid: used bytes} of the live processes on this device, this one included."""
        with self._lock, self._ledger(exclusive=False) as ledger:
            out = _by_visible_pid(self._others(ledger))
            if not self._closed:
                out[self.pid] = self._mine()
        return dict(sorted(out.items()))

    def close(self) -> None:
        """Remove this process's entry (the process is done with the device)."""
        with self._lock, self._ledger(exclusive=True) as ledger:
            self._closed = True
            self._publish(ledger)

    def __enter__(self) -> SharedDeviceMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def published_once(device: DeviceMemory) -> contextlib.AbstractContextManager[None]:
    """The reserves and releases on `device` inside, published in one write where the device
    publishes them (a shared simulated GPU: SharedDeviceMemory.batch); else nothing to do."""
    batch = getattr(device, "batch", None)
    return batch() if batch is not None else contextlib.nullcontext()


def publish_so_far(device: DeviceMemory) -> None:
    """Inside published_once: what it reserved and released so far, published now."""
    publish = getattr(device, "publish_batch", None)
    if publish is not None:
        publish()


# --------------------------------------------------------------------------------------------
# The registry of simulated GPUs


VENDORS = ("nvidia", "amd")


@record(frozen=True)
class SimGpuSpec:
    """One simulated GPU as its driver would report it."""

    index: int
    uuid: str  # as the driver reports it (NVML's GPU-… form, or amdsmi's)
    name: str
    total_bytes: int
    pci_bus_id: str | None = None  # protocol.canonical_pci_bus_id form
    vendor: str = "nvidia"  # "amd": the trainers run "on ROCm" (hip in the hello, a HIP UUID)


def simulated_gpu_specs(
    count: int,
    total_bytes: int = 80 * 2**30,
    name: str | None = None,
    seed: str = "",
    vendor: str = "nvidia",
) -> list[SimGpuSpec]:
    """`count` GPUs with deterministic UUIDs and PCI bus ids.  NVIDIA ones have NVML's UUID
    format, GPU-xxxxxxxx-xxxx-…-xxxxxxxxxxxx; AMD ones amdsmi's, xxxxxxxx-0000-1000-80xx-….

    The same seed gives the same UUIDs, so a viewer and trainers started separately match
    devices by UUID (by PCI bus id on AMD) as memtop does on real hardware.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if vendor not in VENDORS:
        raise ValueError(f"vendor must be one of {', '.join(VENDORS)}, got {vendor!r}")
    amd = vendor == "amd"
    if name is None:
        name = "Simulated AMD Instinct MI300X" if amd else "Simulated H100 80GB HBM3"
    specs = []
    # Here, not at the top: only a demo names its GPUs, and hashlib loads OpenSSL's libcrypto
    # (~3 MB of the dashboard's RSS, which reads the demo's ledgers through this module).
    import hashlib

    for index in range(count):
        h = hashlib.sha256(f"memtop-sim:{seed}:{index}".encode()).hexdigest()
        if amd:
            uuid = f"{h[0:8]}-0000-1000-80{h[8:10]}-{h[20:32]}"
            bus = (0x0C + 0x16 * index) % 0x100  # where an 8-GPU MI300X node has them
        else:
            uuid = f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            bus = (0x18 + 0x10 * index) % 0x100
        specs.append(
            SimGpuSpec(
                index=index,
                uuid=uuid,
                name=name,
                total_bytes=int(total_bytes),
                pci_bus_id=f"0000:{bus:02x}:00.0",
                vendor=vendor,
            )
        )
    return specs


def _spec_from_json(obj: Any) -> SimGpuSpec:
    if not isinstance(obj, dict):
        raise ValueError("gpu entry is not an object")
    index, uuid, name, total = obj["index"], obj["uuid"], obj["name"], obj["total_bytes"]
    for v in (index, total):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("index and total_bytes must be integers")
    if not isinstance(uuid, str) or not isinstance(name, str):
        raise ValueError("uuid and name must be strings")
    if index < 0 or total <= 0:
        raise ValueError("index must be >= 0 and total_bytes > 0")
    # Optional (a registry written before AMD support has neither).
    pci_bus_id = obj.get("pci_bus_id")
    vendor = obj.get("vendor", "nvidia")
    if (pci_bus_id is not None and not isinstance(pci_bus_id, str)) or vendor not in VENDORS:
        raise ValueError("pci_bus_id must be a string and vendor one of " + ", ".join(VENDORS))
    return SimGpuSpec(
        index=index,
        uuid=uuid,
        name=name,
        total_bytes=total,
        pci_bus_id=pci_bus_id,
        vendor=vendor,
    )


def _spec_to_json(spec: SimGpuSpec) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "index": spec.index,
        "uuid": spec.uuid,
        "name": spec.name,
        "total_bytes": spec.total_bytes,
    }
    if spec.pci_bus_id is not None:
        doc["pci_bus_id"] = spec.pci_bus_id
    if spec.vendor != "nvidia":
        doc["vendor"] = spec.vendor
    return doc


class SimGpuRegistry:
    """root/gpus.json lists the simulated GPUs; root/gpu<index>.ledger.json is each one's ledger."""

    FILE_NAME = "gpus.json"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def gpus_path(self) -> Path:
        return self.root / self.FILE_NAME

    def ledger_path(self, index: int) -> Path:
        return self.root / f"gpu{index}.ledger.json"

    def create(self, specs: Sequence[SimGpuSpec]) -> None:
        """Publish `specs`.  Existing ledgers are kept: live processes' entries stay valid."""
        indexes = [s.index for s in specs]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"duplicate GPU indexes in {indexes}")
        self.root.mkdir(parents=True, exist_ok=True)
        for spec in specs:
            path = self.ledger_path(spec.index)
            with _flocked(path, exclusive=True):
                if not path.exists():
                    _write_atomically(path, "{}")
        doc = {
            "version": 1,
            "gpus": [_spec_to_json(s) for s in sorted(specs, key=lambda s: s.index)],
        }
        _write_atomically(self.gpus_path, json.dumps(doc, indent=1))

    def gpus(self) -> list[SimGpuSpec]:
        """The registered GPUs by index; [] when the registry is absent or unreadable."""
        try:
            doc = json.loads(self.gpus_path.read_text(encoding="utf-8"))
            specs = [_spec_from_json(g) for g in doc["gpus"]]
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            return []
        if len({s.index for s in specs}) != len(specs):
            return []
        return sorted(specs, key=lambda s: s.index)

    def spec(self, index: int) -> SimGpuSpec:
        for spec in self.gpus():
            if spec.index == index:
                return spec
        raise KeyError(f"no simulated GPU {index} in {self.gpus_path}")

    def memory(
        self, index: int, pid: int | None = None, overhead_bytes: int = 0
    ) -> SharedDeviceMemory:
        spec = self.spec(index)
        return SharedDeviceMemory(
            self.ledger_path(index), spec.total_bytes, pid=pid, overhead_bytes=overhead_bytes
        )

    def usage_by_pid(self, index: int) -> dict[int, int]:
        """{pid: used bytes} of live processes on GPU `index` ({} when unknown or unreadable).
        A viewer's read: unlocked (see read_ledger)."""
        return dict(sorted(read_ledger(self.ledger_path(index), locked=False).items()))
