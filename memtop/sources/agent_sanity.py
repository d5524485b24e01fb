"""Whether an agent's numbers can be true (DESIGN §6: the viewer trusts no agent): allocated
<= reserved <= total, no negative counter, counters that never go backwards, a GPU the driver
knows (`known_devices` is keyed by UUID without its prefix, model.bare_uuid, and PCI bus id), a
resident set within its high-water mark within the machine's memory (the agent reads the first
two in one read of /proc/self/status, so they agree: memtop.agent.host_memory).
An agent breaking that is `inconsistent` (memtop.sources.agents) and its numbers are not used.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from memtop.model import AgentHello, AgentSample, HostMemory, bare_uuid

# Counters that only ever grow in a trainer (per device; the step per agent).
MONOTONIC_STATS = ("num_alloc_retries", "num_ooms")
# torch's memory_stats() keys that may rightly be negative: max_split_size is -1 when unset
# (an agent sending all of memory_stats(), as the wire contract allows, sends it).
SIGNED_STATS = frozenset({"max_split_size"})


@functools.cache
def this_machine_bytes() -> int | None:
    """This machine's memory (what MemTotal says), or None where it cannot be read.  A live
    agent shares the viewer's machine (AF_UNIX), so its MemTotal is at most this (a container's
    view may be smaller, never larger)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def host_memory_problem(host: HostMemory, machine_bytes: int | None) -> str | None:
    """Why a `host_memory` block cannot be true (2^62 bytes resident on a 1-byte machine), or
    None.  `machine_bytes`: the memory of the machine the agent runs on, where known."""
    rss, peak, total = host.rss_bytes, host.peak_rss_bytes, host.total_bytes
    if rss > peak:
        return f"host memory: resident {rss} > its high-water mark {peak}"
    if total is not None and peak > total:
        return f"host memory: high-water mark {peak} > the machine's {total} bytes"
    # 1 % and a page of slack: MemTotal moves by a few pages (memory hot-plug, ballooning).
    if machine_bytes is not None:
        claimed = peak if total is None else total
        if claimed > machine_bytes * 1.01 + 4096:
            return f"host memory: claims {claimed} bytes on a machine of {machine_bytes} bytes"
    return None


def sanity_problem(
    hello: AgentHello | None,
    sample: AgentSample,
    known_devices: Mapping[str, int] | None,
    counters: dict[str, int],
    machine_bytes: int | None = None,
) -> str | None:
    """Why the numbers of `sample` cannot be true, or None.  `counters` holds the previous
    values of the monotonic counters and is updated in place; `machine_bytes`, the memory of
    the machine the agent runs on (live: this one; a recording's: unknown)."""
    problem = None
    by_index = {d.index: d for d in (hello.devices if hello else ())}
    for device in sample.devices:
        where = f"cuda:{device.index}"
        declared = by_index.get(device.index)
        if declared is None:
            problem = problem or f"{where} is not among the devices its hello listed"
        negative = next(
            (k for k, v in device.stats.items() if v < 0 and k not in SIGNED_STATS), None
        )
        if negative is not None:
            problem = problem or f"{where}: negative {negative}"
        allocated, reserved, total = device.allocated, device.reserved, device.total_bytes
        if allocated > reserved:
            problem = problem or f"{where}: allocated {allocated} > reserved {reserved}"
        if reserved > total or device.free_bytes > total:
            problem = problem or f"{where}: reserved {reserved} or free exceeds total {total}"
        if declared is not None and known_devices is not None:
            driver_total = known_devices.get(declared.uuid)
            if driver_total is None:
                driver_total = known_devices.get(bare_uuid(declared.uuid))
            if driver_total is None and declared.pci_bus_id is not None:
                driver_total = known_devices.get(declared.pci_bus_id)  # ROCm: HIP's UUID
            if driver_total is None and not declared.uuid.startswith("MIG-"):
                problem = problem or f"{where}: GPU {declared.uuid!r} is unknown to the driver"
            elif driver_total is not None and total > driver_total * 1.01:
                problem = problem or (
                    f"{where}: claims {total} bytes on a GPU of {driver_total} bytes"
                )
        for key in MONOTONIC_STATS:
            value = device.stats.get(key)
            if value is None:
                continue
            name = f"{device.index}:{key}"
            before = counters.get(name)
            if before is not None and value < before:
                problem = problem or f"{where}: {key} went backwards ({before} -> {value})"
            counters[name] = value
    if sample.step is not None:
        before = counters.get("step")
        if sample.step < 0 or (before is not None and sample.step < before):
            problem = problem or f"step went backwards ({before} -> {sample.step})"
        counters["step"] = sample.step
    if sample.host_memory is not None:
        problem = problem or host_memory_problem(sample.host_memory, machine_bytes)
    return problem
