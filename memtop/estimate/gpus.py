"""Capacities of GPUs by name, as the driver reports their total memory (nvidia-smi's MiB)."""

from __future__ import annotations

import re

from memtop.units import GiB, MiB

# The H100's figure is what its driver reported in shared/traces/cuda-h100; the others are
# nvidia-smi's "Total" of each board.
NAMED_GPUS: dict[str, int] = {
    "h100-80gb": 85_017_493_504,
    "h100-94gb": 95_830 * MiB,
    "h200": 143_771 * MiB,
    "a100-80gb": 81_920 * MiB,
    "a100-40gb": 40_960 * MiB,
    "l40s": 46_068 * MiB,
    "a10g": 23_028 * MiB,
    "l4": 23_034 * MiB,
    "rtx4090": 24_564 * MiB,
    "rtx3090": 24_576 * MiB,
    "v100-32gb": 32_768 * MiB,
    "v100-16gb": 16_384 * MiB,
    "t4": 15_360 * MiB,
}
ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "v100": "v100-32gb"}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|mib|mb|g|m)?\s*$", re.IGNORECASE)
MAX_GPU_BYTES = 64 * 1024 * GiB  # far above any GPU: a typo, not a board
_UNITS = {"gib": GiB, "g": GiB, "gb": 10**9, "mib": MiB, "m": MiB, "mb": 10**6}


def named_gpu(name: str) -> tuple[str, int] | None:
    """A GPU by name (`h100-80gb`), or a capacity (`24GiB`, `8.5GB`: a MIG slice, a memory
    fraction); None when it is neither."""
    try:
        return parse_gpu(name)
    except ValueError:
        return None


def parse_gpu(name: str) -> tuple[str, int]:
    """(name, capacity in bytes) of `--gpu NAME`; ValueError with one line for the user."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    capacity = NAMED_GPUS.get(key)
    if capacity is not None:
        return key, capacity
    size = _SIZE.match(name)
    if size is None:
        raise ValueError(
            f"--gpu {name!r}: unknown GPU; known: {', '.join(NAMED_GPUS)}, or a size (24GiB)"
        )
    unit = _UNITS[(size.group(2) or "gib").lower()]
    capacity = int(float(size.group(1)) * unit)
    if capacity < MiB:
        raise ValueError(f"--gpu {name!r}: a GPU's memory must be at least 1 MiB")
    if capacity > MAX_GPU_BYTES:
        raise ValueError(f"--gpu {name!r}: more memory than any GPU (at most 64 TiB)")
    return f"{name.strip()} GPU", capacity
