"""Capacities of GPUs by name, as the driver reports their total memory (nvidia-smi's MiB)."""

from __future__ import annotations

import re

from memtop.figures.units import GiB, MiB

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
    # AMD Instinct: the HBM each GPU (an MI250's GCD) has, as amd-smi counts it.
    "mi300x": 192 * GiB,
    "mi250": 64 * GiB,  # per GCD: an MI250 is two GPUs of 64 GiB to torch and amd-smi
    "mi210": 64 * GiB,
}
# The boards MIG splits, and the memory they are named by (the "80gb" of "a100-80gb"): a MIG
# profile `Ng.Mgb` holds M/board-GB of the board's memory, in eighths (NVIDIA's MIG user
# guide, "Supported MIG Profiles": 1g 1/8 or 2/8, 2g 2/8, 3g and 4g 4/8, 7g the whole board).
MIG_BOARDS = {"a100-40gb": 40, "a100-80gb": 80, "h100-80gb": 80, "h100-94gb": 94, "h200": 141}
MIG_SLICES = {1: (1, 2), 2: (2,), 3: (4,), 4: (4,), 7: (8,)}
_MIG = re.compile(r"^(\d)g\.(\d+)gb$")
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
    if ":" in key:
        return parse_mig(name, key)
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


def parse_mig(name: str, key: str) -> tuple[str, int]:
    """`a100-80gb:3g.40gb`: a MIG instance of that profile, its share of the board's memory."""
    board, _, profile = key.partition(":")
    board = ALIASES.get(board, board)
    if board not in MIG_BOARDS:
        raise ValueError(
            f"--gpu {name!r}: MIG profiles are known on {', '.join(MIG_BOARDS)} (board:profile)"
        )
    found = _MIG.match(profile.removeprefix("mig-").removeprefix("mig "))
    eighths = None
    if found:
        slices, size = int(found.group(1)), int(found.group(2))
        nominal = MIG_BOARDS[board]
        for share in MIG_SLICES.get(slices, ()):
            if abs(nominal * share / 8 - size) <= 1.5:  # names round: 94/8 = 11.75 -> 12gb
                eighths = share
    if eighths is None:
        raise ValueError(
            f"--gpu {name!r}: {profile!r} is not a MIG profile of {board} "
            f"(e.g. {board}:1g.{round(MIG_BOARDS[board] / 8)}gb, "
            f"{board}:3g.{round(MIG_BOARDS[board] / 2)}gb)"
        )
    return f"{board} MIG {profile}", NAMED_GPUS[board] * eighths // 8
