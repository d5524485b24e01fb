"""Why one OOM happened, from its report alone: a pure function.

The causes, checked in this order (the first that the evidence supports is the verdict; the
others that also hold are listed):
- another_process: the driver had less free than the request while this process stayed under
  its limit, and the driver's per-process usage shows someone else holding the GPU;
- unknown_holder: the same shortage without the driver's per-process usage: another process,
  or this one outside PyTorch; both are named, with what tells them apart;
- growing_batch: the bytes each step allocates (the growth of torch's cumulative
  `allocated_bytes.all.allocated` between step marks, per step; from a recording, the rise of
  the baseline each step leaves) rose step after step up to the OOM, and after each earlier
  OOM too: a batch or sequence that grows; cap it;
- outside_pytorch: the same shortage, but the driver's per-process usage (in the report since
  issue 24) shows this process itself holding the bytes outside torch's cache;
- leak: the per-step baseline (allocated right after each step) rose steadily; named by its
  line when stacks were recorded and a site of the report grew with it over the agent's kept
  rounds (DESIGN §13);
- fragmentation: the cache held more free bytes than the request, in no block as large:
  expandable segments;
- too_big: none of those: the step needs more than the GPU has.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from memtop.base import alloc_conf
from memtop.base.user_frame import site_name
from memtop.figures.median import median
from memtop.figures.units import MiB, format_bytes

CONTEXT_BYTES = 512 * MiB  # the process's own CUDA context, outside torch's counters
MIN_RUN = 3  # consecutive growing steps that make a growing batch
MIN_GROWTH = 1.05  # per step
STRONG_GROWTH = 1.5  # per step: growth after two steps (a doubling batch fails at its third)
MIN_BASELINE_RISE = 1 * MiB  # a baseline rise below this is noise, not a step's growth
MIN_BASELINE_COVERAGE = 0.5  # of the steps, in runs of growing baselines (see growing_batch)
LEAK_MIN_BYTES_PER_STEP = 1 * MiB
# A site is the leak's as memtop.diagnosis.sites judges it on the dashboard (not imported: the
# agent imports this module): readings enough, never falling, blocks that outlive a reading,
# and at least this share of the leak's rate.
SITE_MIN_READINGS = 3
SITE_LEAK_SHARE = 0.25


def _int(report: dict[str, Any], key: str) -> int | None:
    value = report.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def step_sizes(
    recent: list[dict[str, Any]], ooms: list[float] | tuple[float, ...] = ()
) -> list[list[tuple[int, float]]]:
    """What each step allocated, as runs of (step, size) oldest first, between OOMs.

    From torch's cumulative counter when the marks carry it (`allocated_total_bytes`, live
    agents): the bytes allocated between consecutive marks, per step; an interval with an OOM
    in it (the failed step's allocations count there too) is left out and ends a run.

    Without it (a recording's marks hold only the baseline after each step): what each step
    left allocated above the step before, which grows with a growing batch as its allocations
    do (the logits and hidden state it keeps until the next step); a fall of the baseline (the
    batch cut back after an OOM) ends a run."""
    if not any(isinstance(m.get("allocated_total_bytes"), int) for m in recent):
        return _baseline_steps(recent)
    runs: list[list[tuple[int, float]]] = [[]]
    previous = None
    # Sorted, so that "an OOM between two marks" is two binary searches, not a walk of every
    # OOM at every mark (a report's lists are bounded too: memtop.oom.reports).
    oom_times = sorted(ooms)
    for mark in recent:
        total, step, when = mark.get("allocated_total_bytes"), mark.get("step"), mark.get("time")
        if not isinstance(total, int) or not isinstance(step, int):
            continue
        if previous is not None and step > previous[0] and total >= previous[1]:
            if isinstance(when, int | float) and bisect.bisect_right(
                oom_times, previous[2]
            ) < bisect.bisect_right(oom_times, when):
                runs.append([])
            else:
                runs[-1].append((step, (total - previous[1]) / (step - previous[0])))
        previous = (step, total, when if isinstance(when, int | float) else 0.0)
    return [run for run in runs if run]


def _baseline_steps(recent: list[dict[str, Any]]) -> list[list[tuple[int, float]]]:
    runs: list[list[tuple[int, float]]] = [[]]
    previous = None
    for mark in recent:
        base, step = mark.get("allocated_bytes"), mark.get("step")
        if not isinstance(base, int) or not isinstance(step, int):
            continue
        if previous is not None and step == previous[0] + 1:
            rise = base - previous[1]
            if rise >= MIN_BASELINE_RISE:
                runs[-1].append((step, float(rise)))
            else:
                runs.append([])  # flat or fallen: a cut-back batch, or no growth to judge
        elif previous is not None:
            runs.append([])  # a step without its mark: the run cannot be followed
        previous = (step, base)
    return [run for run in runs if run]


def growth(runs: list[list[tuple[int, float]]]) -> tuple[float, int, int] | None:
    """(median growth per step, steps seen growing, first step) when the step sizes grew step
    after step within each stretch between OOMs (a batch that grows, halves at an OOM, grows
    again is still a growing batch), the newest included.  A step ×1.5 the one before (a
    batch that doubles fails after two steps) is growth after two steps."""
    if not runs:
        return None
    ratios = [b[1] / a[1] for run in runs for a, b in itertools.pairwise(run) if a[1] > 0]
    last = runs[-1]
    if len(last) >= 2:
        last_ratio = last[-1][1] / last[-2][1] if last[-2][1] > 0 else 0.0
        last_rises = last_ratio >= MIN_GROWTH
        needed = 1 if last_ratio >= STRONG_GROWTH else MIN_RUN - 1
    else:
        # The newest stretch is one step: a batch that doubles in a few steps and halves at
        # each OOM leaves a single step between OOMs as often as not (with step marks taken
        # every other step on a fast trainer, more often). Judge on the earlier stretches then,
        # but want twice the evidence.
        last_rises = True
        needed = 2 * (MIN_RUN - 1)
    if len(ratios) < needed:
        return None
    rising = [r for r in ratios if r >= MIN_GROWTH]
    if len(rising) < 0.8 * len(ratios) or not last_rises:
        return None
    return median(ratios), len(rising), runs[0][0][0]


def growing_batch(
    recent: list[dict[str, Any]], oom_times: list[float] | tuple[float, ...], headline: str
) -> dict[str, Any] | None:
    """The growing-batch finding from step marks and OOM times, or None: one home for the OOM
    report's diagnosis and for a run seen without a report (a recording, `memtop replay`),
    where the marks and the OOM counter are all there is."""
    runs = step_sizes(recent, oom_times)
    if not any(isinstance(m.get("allocated_total_bytes"), int) for m in recent):
        # From baselines alone, a few rises in a row happen by chance when sequence lengths
        # vary (the `fragment` recordings: 10-36 % of the steps in such runs); a batch that
        # grows until each OOM keeps most of its steps in them (the `oom` recording: 64-68 %).
        steps = sum(isinstance(m.get("step"), int) for m in recent)
        growing_steps = sum(len(run) for run in runs if len(run) >= 2)
        if growing_steps < MIN_BASELINE_COVERAGE * max(1, steps - 1):
            return None
    grew = growth(runs)
    if grew is None:
        return None
    ratio, run, first = grew
    # The last step that fitted allocated 1/ratio of what the failing one needed.
    return {
        "cause": "growing_batch",
        "detail": (
            f"{headline}: the peak grew with the batch (each step allocated "
            f"×{ratio:.2f} the step before; {run} steps grew since step {first})"
        ),
        "fix": (
            f"cap the batch (or sequence length) at about {1 / ratio:.0%} of the one "
            "that failed: the last size that fitted"
        ),
        "growth_per_step": ratio,
        "growing_steps": run,
    }


def _theil_sen(points: list[tuple[float, float]]) -> float:
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if x2 != x1
    ]
    return median(slopes) if slopes else 0.0


def leak_rate(recent: list[dict[str, Any]]) -> tuple[float, int] | None:
    """(bytes per step, first step) when the per-step baseline rose steadily."""
    points = [
        (float(m["step"]), float(m["allocated_bytes"]))
        for m in recent
        if isinstance(m.get("step"), int) and isinstance(m.get("allocated_bytes"), int)
    ][-200:]
    if len(points) < 8:
        return None
    slope = _theil_sen(points[:: max(1, len(points) // 60)])
    rises = sum(b[1] >= a[1] for a, b in itertools.pairwise(points))
    growth = points[-1][1] - points[0][1]
    if (
        slope >= LEAK_MIN_BYTES_PER_STEP
        and rises >= 0.8 * (len(points) - 1)
        and growth >= 4 * LEAK_MIN_BYTES_PER_STEP
    ):
        return slope, int(points[0][0])
    return None


# What each part of the memory, when it is the largest, is cut by.
PART_FIXES = {
    "optimizer_state": "an 8-bit optimizer (its state is the largest part)",
    "parameters": "bf16 weights (the parameters are the largest part)",
    "gradients": "bf16 gradients or gradient accumulation over smaller batches",
    "other": "gradient checkpointing or a smaller batch (activations are the largest part)",
}


def _too_big_fix(breakdown: object) -> str:
    """The fix for a step that does not fit: led by the largest part of the breakdown when the
    agent had measured one; without it, which fix helps most is not known, and it says so."""
    generic = (
        "a smaller batch, gradient checkpointing, bf16 weights or an 8-bit optimizer; "
        "`memtop estimate` says what fits"
    )
    parts = {
        key: value
        for key, value in (breakdown.items() if isinstance(breakdown, dict) else ())
        if key in PART_FIXES and isinstance(value, int | float) and value > 0
    }
    if not parts:
        return (
            f"{generic} (which helps most is not known: no breakdown was measured before this "
            "OOM; the agent measures one after an optimizer step)"
        )
    largest = max(parts, key=lambda key: parts[key])
    return f"{PART_FIXES[largest]}, else {generic}"


def leak_site(sites: Any, rate: float) -> dict[str, Any] | None:
    """The report's site whose bytes grew with the leak (its growth over the agent's kept rounds,
    DESIGN §13), the fastest first; None without one (no stacks, an older agent, no growth)."""
    best: dict[str, Any] | None = None
    for entry in sites if isinstance(sites, list) else []:
        if not isinstance(entry, dict):
            continue
        per_step = entry.get("bytes_per_step")
        if isinstance(per_step, bool) or not isinstance(per_step, int | float):
            continue
        readings, falls, old = (_int(entry, k) for k in ("readings", "falls", "old_blocks"))
        if readings is None or falls is None or old is None:
            continue
        if readings < SITE_MIN_READINGS or falls > 0 or old <= 0:
            continue
        if per_step < SITE_LEAK_SHARE * rate or per_step <= 0:
            continue
        if best is None or per_step > best["bytes_per_step"]:
            best = entry
    return best


def diagnose(report: dict[str, Any]) -> dict[str, Any]:
    """{cause, detail, fix, also}: what the user reads first, and the other causes in view."""
    requested = _int(report, "requested_bytes") or 0
    free = _int(report, "free_bytes")
    limit = _int(report, "limit_bytes")
    total = _int(report, "total_bytes") or limit
    allocated = _int(report, "allocated_bytes") or 0
    reserved = _int(report, "reserved_bytes") or 0
    largest = _int(report, "largest_free_block_bytes")
    step = report.get("step")
    phase = report.get("phase") or "an unknown phase"
    recent = [m for m in report.get("recent") or [] if isinstance(m, dict)]
    conf = str(report.get("allocator_conf") or "")
    where = f"in {phase}" + (f" at step {step}" if isinstance(step, int) else "")
    headline = f"needed {format_bytes(requested)} {where} with {format_bytes(free)} free on the GPU"
    found: list[dict[str, Any]] = []

    # Someone else holds the GPU: the driver's free is short while we are under our limit.
    # With the driver's per-process usage (read by the agent at the OOM) the bytes outside
    # torch's cache are split into this process's own (NCCL, cuDNN workspaces, another
    # library) and other processes'.  Without it memtop cannot tell the two apart, and says
    # so (unknown_holder): both are named, with what would tell them apart (issue 31, item 7).
    own_outside = _int(report, "own_non_pytorch_bytes")
    other_processes = _int(report, "other_processes_bytes")
    if free is not None and total is not None and free < requested:
        split = own_outside is not None and other_processes is not None
        others = other_processes if split else total - free - reserved - CONTEXT_BYTES
        assert others is not None
        under_limit = limit is None or reserved + requested <= limit
        enough = max(requested, total // 20)
        if under_limit and not split and others > enough:
            found.append(
                {
                    "cause": "unknown_holder",
                    "detail": (
                        f"{headline}: {format_bytes(others)} of this GPU is held outside this "
                        f"process's PyTorch cache (it reserved {format_bytes(reserved)}), and "
                        "the driver's per-process usage was not available, so memtop cannot "
                        "say whose: another process on this GPU, or this process itself "
                        "outside PyTorch (NCCL buffers, cuDNN/cuBLAS workspaces, a library such "
                        "as JAX or CuPy preallocating). What tells them apart: the driver's "
                        "list of processes on this GPU and what each uses"
                    ),
                    "fix": (
                        "nvidia-smi --query-compute-apps=pid,used_memory --format=csv: another "
                        "pid holding it → move one job or stop it; only this pid → find the "
                        "library (NCCL_BUFFSIZE, cudnn.benchmark=False, "
                        "XLA_PYTHON_CLIENT_PREALLOCATE=false)"
                    ),
                    "unattributed_bytes": others,
                    "possibilities": ["another_process", "outside_pytorch"],
                }
            )
        elif under_limit and others > enough:
            found.append(
                {
                    "cause": "another_process",
                    "detail": (
                        f"{headline}: another process took {format_bytes(others)} on this GPU "
                        f"(this one reserved {format_bytes(reserved)} and holds "
                        f"{format_bytes(own_outside)} outside PyTorch)"
                    ),
                    "fix": "see who with `memtop`; move one job to another GPU or stop it",
                    "other_bytes": others,
                }
            )
        elif under_limit and split and own_outside is not None and own_outside > enough:
            found.append(
                {
                    "cause": "outside_pytorch",
                    "detail": (
                        f"{headline}: this process holds {format_bytes(own_outside)} outside "
                        f"PyTorch's cache (its CUDA context, NCCL buffers, cuDNN/cuBLAS "
                        f"workspaces, another library); other processes hold "
                        f"{format_bytes(other_processes)}"
                    ),
                    "fix": (
                        "find the library: NCCL_BUFFSIZE / fewer communicators, "
                        "torch.backends.cudnn.benchmark=False, a framework (JAX, TensorFlow, "
                        "CuPy) preallocating; or leave it room with a smaller batch"
                    ),
                    "own_non_pytorch_bytes": own_outside,
                }
            )

    oom_times = [
        float(e["time"])
        for e in report.get("recent_ooms") or []
        if isinstance(e, dict) and isinstance(e.get("time"), int | float)
    ]
    grew = growing_batch(recent, oom_times, headline)
    if grew is not None:
        found.append(grew)

    leak = leak_rate(recent)
    if leak is not None:
        rate, since = leak
        culprit = leak_site(report.get("sites"), rate)
        named = site_name(culprit["site"]) if culprit is not None else None
        where = f", from `{named}`" if named else ""
        look = f"see what keeps the blocks from {named.split(' ', 1)[0]} alive" if named else ""
        found.append(
            {
                "cause": "leak",
                "detail": (
                    f"{headline}: leak of {format_bytes(rate)}/step since step {since}{where}"
                ),
                "fix": (
                    (look or "look for tensors kept across steps")
                    + ": a loss summed with its graph (use loss.item()), outputs appended to "
                    "a list, hooks, retain_graph=True"
                ),
                "bytes_per_step": rate,
                **({"site": culprit["site"]} if named and culprit is not None else {}),
            }
        )

    cached = reserved - allocated
    if largest is not None and cached >= requested > largest:
        expandable = alloc_conf.parse(conf).expandable_segments  # as torch reads it
        # ROCm builds of torch read PYTORCH_HIP_ALLOC_CONF (diagnosis.suggestions says when).
        variable = "PYTORCH_HIP_ALLOC_CONF" if report.get("hip") else "PYTORCH_CUDA_ALLOC_CONF"
        found.append(
            {
                "cause": "fragmentation",
                "detail": (
                    f"{headline}: {format_bytes(cached)} free in PyTorch's cache but no block "
                    f"larger than {format_bytes(largest)}: fragmentation"
                ),
                "fix": (
                    "already on expandable segments: free long-lived tensors allocated "
                    "between activations, or pad variable shapes to a few sizes"
                    if expandable
                    else f"{variable}=expandable_segments:True"
                ),
                "cached_free_bytes": cached,
            }
        )

    if not found:
        room = f" of a {format_bytes(limit)} limit" if limit else ""
        found.append(
            {
                "cause": "too_big",
                "detail": (
                    f"{headline}: {format_bytes(allocated)} allocated{room}; "
                    "the step needs more than the GPU has"
                ),
                "fix": _too_big_fix(report.get("breakdown")),
            }
        )
    verdict = dict(found[0])
    verdict["also"] = [f["cause"] for f in found[1:]]
    return verdict
