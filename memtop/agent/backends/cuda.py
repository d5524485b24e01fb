"""The CUDA/ROCm device backend: torch.cuda inside the trainer (on ROCm, torch.cuda is HIP).

The only module of memtop that names torch.cuda (tests/test_probe_seam.py checks).  Rules it
keeps:
- it never initialises CUDA: until the trainer has initialised it, there are no devices;
- it only reads devices the trainer has a context on, so it creates no context elsewhere;
- every call is wrapped by the agent, which turns any exception into an error frame;
- each method runs on the thread its mark in memtop.agent.probe says (DESIGN §6).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from memtop.agent.probe import (
    SAMPLE_STAT_KEYS,
    OomObserver,
    ProbeDevice,
    allocator_conf_from_env,
    any_thread,
    trainer_thread,
)
from memtop.protocol.text import pci_bus_id_of

NAME = "cuda"


def detect() -> CudaBackend | None:
    """torch.cuda is in every build of torch (a CPU build has no device behind it, and says so
    without initialising anything): this backend is the default, asked last."""
    return CudaBackend() if hasattr(torch, "cuda") else None


def _allocator_conf() -> str:
    return allocator_conf_from_env(os.environ)


def _pci_bus_id(props: Any) -> str | None:
    """The device's PCI address from torch's properties (pci_domain_id, pci_bus_id,
    pci_device_id: CUDA and ROCm builds of torch >= 2.3 have them), None without them."""
    names = ("pci_domain_id", "pci_bus_id", "pci_device_id")
    numbers = [getattr(props, name, None) for name in names]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        return None
    domain, bus, device = (int(n) for n in numbers if n is not None)
    return pci_bus_id_of(domain, bus, device)


# The nested path of each SAMPLE_STAT_KEYS key in torch._C._cuda_memoryStats()'s dict.
# torch's max_entries for stack recording: a bound on its trace ring (unused by enabled="state",
# which keeps only the live blocks' stacks, but bounded all the same).
HISTORY_MAX_ENTRIES = 10_000
_SAMPLE_PATHS = tuple((key, tuple(key.split("."))) for key in SAMPLE_STAT_KEYS)


def _pick_stats(nested: dict[str, Any]) -> dict[str, int]:
    """SAMPLE_STAT_KEYS out of the allocator's nested stats, without flattening all ~120."""
    out: dict[str, int] = {}
    for key, path in _SAMPLE_PATHS:
        value: Any = nested
        for part in path:
            if not isinstance(value, dict):
                break
            value = value.get(part)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = int(value)
    return out


class CudaBackend:
    """`memtop.agent.probe.DeviceBackend` (and all of `BackendExtras` but current_pass) over
    torch.cuda."""

    tensor_device_type = "cuda"

    def __init__(self) -> None:
        self._device_cache: dict[int, ProbeDevice] = {}
        self._written: str | None = None  # the option string memtop last set (torch < 2.9)

    @any_thread
    def hip_version(self) -> str | None:
        hip = getattr(torch.version, "hip", None)
        return str(hip) if hip else None

    @any_thread
    def allocator_settings(self) -> str | None:
        """Any thread: the allocator's option string in force.  torch >= 2.9 keeps it and reads
        it back (`_accelerator_getAllocatorSettings`: a copy of a host-side string taken under
        its own mutex, c10/core/AllocatorConfig.h `last_allocator_settings()`, so any thread may
        read it); an older torch has only a setter, so it is what memtop last wrote, else the
        environment's."""
        read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        if read is not None:
            return str(read())
        return self._written if self._written is not None else _allocator_conf()

    @trainer_thread
    def set_allocator_settings(self, text: str) -> None:
        """Trainer's thread, at a step boundary: the whole option string (torch's parser
        resets every key it leaves out).  New segments follow it; cached ones keep their kind."""
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            memory = getattr(torch.cuda, "memory", None)
            setter = getattr(memory, "_set_allocator_settings", None)
        if setter is None:
            raise NotImplementedError(
                f"torch {torch.__version__} cannot change allocator settings while it runs"
            )
        setter(text)
        self._written = text

    def _used_indices(self) -> list[int]:
        # is_initialized() first: is_available() would call cudaGetDeviceCount, initialising
        # the CUDA driver in a trainer that has not (yet) touched CUDA itself.
        if not torch.cuda.is_initialized() or not torch.cuda.is_available():
            return []
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        indices = []
        for index in range(torch.cuda.device_count()):
            if has_context is None or has_context(index):
                indices.append(index)
        return indices

    @any_thread
    def devices(self) -> list[ProbeDevice]:
        found = []
        for index in self._used_indices():
            device = self._device_cache.get(index)
            if device is None:
                props = torch.cuda.get_device_properties(index)
                # As torch gives it (bare: CUDA's cuDeviceGetUuid_v2, a MIG instance's own or,
                # through older paths, its GPU's): a `GPU-` prefix made a MIG instance's UUID
                # one the driver never lists.  The viewer compares UUIDs without the prefix.
                uuid = str(getattr(props, "uuid", "") or "")
                device = ProbeDevice(
                    index, uuid, str(props.name), int(props.total_memory), _pci_bus_id(props)
                )
                self._device_cache[index] = device
            found.append(device)
        return found

    @any_thread
    def memory_stats(self, index: int) -> dict[str, int]:
        # torch.cuda.memory_stats() flattens and sorts all ~120 counters (150 µs on an H100);
        # the raw nested dict is 21.5 µs and holds the same numbers.  Host-side counters only.
        if not torch.cuda.is_initialized():
            return {}
        raw = getattr(torch._C, "_cuda_memoryStats", None)
        if raw is None:
            return {k: int(v) for k, v in torch.cuda.memory_stats(index).items()}
        return _pick_stats(raw(index))

    @trainer_thread
    def is_capturing(self) -> bool:
        if not torch.cuda.is_initialized():
            return False
        try:
            return bool(torch.cuda.is_current_stream_capturing())
        except Exception:
            return True  # when in doubt, touch nothing

    @any_thread
    def memory_allocated(self, index: int) -> int:
        # Runs on the trainer's thread after every step.  torch.cuda.memory_allocated() flattens
        # all ~120 allocator stats into a sorted dict first (tens of µs, a measurable share of a
        # short step); the nested dict it flattens has the same number one lookup away.
        if not torch.cuda.is_initialized():
            return 0  # as torch.cuda.memory_allocated() says, without touching CUDA
        try:
            return int(torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]["current"])
        except (AttributeError, KeyError, TypeError):
            return int(torch.cuda.memory_allocated(index))

    @any_thread
    def mark_reading(self, index: int) -> tuple[int, int, int]:
        """(allocated now, its peak, bytes ever allocated) from one host-side allocator read:
        what a step mark records."""
        if not torch.cuda.is_initialized():
            return 0, 0, 0
        try:
            counts = torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]
            return int(counts["current"]), int(counts["peak"]), int(counts["allocated"])
        except (AttributeError, KeyError, TypeError):
            return int(torch.cuda.memory_allocated(index)), 0, 0

    @trainer_thread
    def mem_get_info(self, index: int) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)

    @trainer_thread
    def empty_cache(self, index: int) -> None:
        with torch.cuda.device(index):
            torch.cuda.empty_cache()

    @any_thread
    def reset_peak(self, index: int) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    @trainer_thread
    def snapshot(self) -> dict[str, Any]:
        if not self._used_indices():
            return {"segments": [], "device_traces": []}
        return dict(torch.cuda.memory._snapshot())

    @trainer_thread
    def record_history(self, enabled: bool) -> bool:
        """Stack recording in its cheapest form that still keeps each live block's allocating
        stack: state only (no trace ring), allocation context, Python frames.  The trainer's
        thread at a step boundary only (DESIGN §6).  False while no device is in use (nothing
        to record yet: CUDA is not initialised here for it)."""
        indices = self._used_indices()
        if not indices:
            return False
        record = torch.cuda.memory._record_memory_history
        for index in indices:
            if enabled:
                record(
                    enabled="state",
                    context="alloc",
                    stacks="python",
                    max_entries=HISTORY_MAX_ENTRIES,
                    device=index,
                )
            else:
                record(enabled=None, device=index)
        return True

    @any_thread
    def attach_oom_observer(self, observer: OomObserver) -> bool:
        """Have `observer(device, alloc_size, memory limit, device free)` called by the CUDA
        caching allocator at every out-of-memory, on the allocating thread, with the allocator's
        lock released.  The allocator keeps observers per device, so they can only be attached
        once CUDA is initialised: torch's lazy-init queue runs the attach right after the
        trainer initialises CUDA (or now, if it has).  Never initialises CUDA itself."""
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if attach is None or lazy_call is None:
            return False  # a CPU build of torch: no CUDA allocator to observe

        def register() -> None:
            with contextlib.suppress(Exception):  # nothing may fail the trainer's CUDA init
                attach(observer)

        lazy_call(register)
        return True
