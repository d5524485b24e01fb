"""The suggestions engine: rules that turn the diagnosis into what to do, with the evidence and
the effect in bytes where it can be known (DESIGN §5).

Every rule is a function of the facts about one GPU (`GpuFacts`, with the diagnosis of each
agent device on it) returning zero or more suggestions.  Rules never suggest what the trainer
already has: the allocator settings are read from the trainer's own environment through its
agent.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from memtop.diagnosis.facts import (
    DeviceDiagnosis,
    GpuFacts,
    has_expandable_segments,
    parse_allocator_conf,
    uses_async_backend,
)
from memtop.diagnosis.sites import leaking_site
from memtop.estimate.calibrate import BatchModel
from memtop.model import Severity
from memtop.sites import site_name, stack_phrase
from memtop.units import MiB, format_bytes, format_duration

INFO, WARNING, CRITICAL, EMERGENCY = (
    Severity.INFO,
    Severity.WARNING,
    Severity.CRITICAL,
    Severity.EMERGENCY,
)
SEVERITIES = tuple(Severity)  # in rising order

USAGE_LEVELS = ((0.95, EMERGENCY), (0.90, CRITICAL), (0.85, WARNING))
FRAGMENTATION_GAUGE = 0.2  # the smoothed gauge at which split segments are worth fixing
FRAGMENTATION_MIN_BYTES = 128 * MiB  # ... when that much is stuck in them
FRAGMENTATION_MIN_SAMPLES = 3  # ... judged on the median of at least this many readings
CLEANUP_MIN_BYTES = 512 * MiB
OPTIMIZER_SHARE = 0.2  # optimizer state as a share of the peak worth an 8-bit optimizer
FP32_SHARE = 0.1  # fp32 parameters as a share of the peak worth a bf16 model
BIG_ENOUGH = 512 * MiB  # below this, a saving is not worth a suggestion
ACTIVATION_SHARE = 0.5  # activations as a share of the peak worth checkpointing
TIGHT_USAGE = 0.80  # checkpointing is suggested only when memory is this tight
ROOMY_USAGE = 0.70  # a bigger batch is suggested only below this usage
BATCH_FACTOR_MIN = 1.3
SAFETY_SHARE = 0.05  # of the device kept free when sizing a bigger batch

# Hysteresis: a suggestion already on screen ("held") stays until its measure is clearly back,
# not merely a hair under the line it crossed; a gauge hovering at 0.20 must not flap.  Shares
# of the device move by HOLD_SHARE, other limits by HOLD_FACTOR of themselves.  The minimum
# time on screen is memtop.diagnosis.stability's.
HOLD_SHARE = 0.03
HOLD_FACTOR = 0.15

Key = tuple[str, int | None, int | None]  # (rule, pid, device): a suggestion's identity
NOTHING_HELD: frozenset[Key] = frozenset()


def _at_least(value: float, limit: float, held: bool, share: bool = False) -> bool:
    """value ≥ limit, or for a held suggestion ≥ the lower exit limit."""
    if held:
        limit = limit - HOLD_SHARE if share else limit * (1 - HOLD_FACTOR)
    return value >= limit


def _below(value: float, limit: float, held: bool, share: bool = False) -> bool:
    """value < limit, or for a held suggestion < the higher exit limit."""
    if held:
        limit = limit + HOLD_SHARE if share else limit * (1 + HOLD_FACTOR)
    return value < limit


@dataclass(frozen=True, slots=True)
class Suggestion:
    rule: str
    severity: Severity
    pid: int | None
    device: int | None  # the agent's device index (the NVML index for GPU-wide findings)
    title: str
    detail: str
    evidence: str
    fix: str | None = None  # one line a user can copy
    effect_bytes: int | None = None  # bytes saved / freed / made usable, when known

    def as_dict(self) -> dict[str, Any]:
        return {
            "severity": Severity(self.severity).value,
            "pid": self.pid,
            "device": self.device,
            "title": self.title,
            "detail": self.detail,
            "rule": self.rule,
            "evidence": self.evidence,
            "fix": self.fix,
            "effect_bytes": self.effect_bytes,
        }

    @property
    def key(self) -> Key:
        return (self.rule, self.pid, self.device)


# A rule judges one GPU; `held` holds the keys of the suggestions on screen now (hysteresis).
Rule = Callable[..., Iterable[Suggestion]]


def _pct(share: float) -> str:
    return f"{100 * share:.1f} %"


def _heaviest(gpu: GpuFacts) -> DeviceDiagnosis | None:
    return max(gpu.agents, key=lambda a: a.reserved_bytes, default=None)


# ------------------------------------------------------------------------------ the rules


def usage(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    """85 % warning, 90 % critical, 95 % emergency of the device's memory in use."""
    share = gpu.used_share
    if share is None or gpu.used_bytes is None:
        return
    heaviest = _heaviest(gpu)
    key = ("usage", heaviest.pid if heaviest else None, heaviest.index if heaviest else gpu.index)
    was = key in held
    severity = next(
        (level for limit, level in USAGE_LEVELS if _at_least(share, limit, was, share=True)), None
    )
    if severity is None:
        return
    evidence = f"{format_bytes(gpu.used_bytes)} of {format_bytes(gpu.total_bytes)} used"
    if heaviest is not None:
        evidence += (
            f"; pid {heaviest.pid} reserves {format_bytes(heaviest.reserved_bytes)}"
            f" ({format_bytes(heaviest.cached_bytes)} of it cached)"
        )
    cached = sorted(gpu.agents, key=lambda a: a.releasable_bytes, reverse=True)
    if cached and cached[0].releasable_bytes >= CLEANUP_MIN_BYTES and gpu.process_count > 1:
        detail = (
            f"pid {cached[0].pid} holds {format_bytes(cached[0].releasable_bytes)} of cache it "
            "could give back (c in the dashboard)."
        )
        fix: str | None = f"memtop cleanup {cached[0].pid}"
    else:
        detail = (
            "The next larger batch or sequence may not fit: lower the batch size or sequence "
            "length, or act on the other suggestions."
        )
        fix = None
    yield Suggestion(
        rule="usage",
        severity=severity,
        pid=heaviest.pid if heaviest else None,
        device=heaviest.index if heaviest else gpu.index,
        title=f"GPU {gpu.index} memory at {_pct(share)}",
        detail=detail,
        evidence=evidence,
        fix=fix,
        effect_bytes=max(0, gpu.used_bytes - int(0.85 * gpu.total_bytes)),
    )


# The causes of memtop.oom.diagnose, as a suggestion's title says them.
OOM_CAUSES = {
    "growing_batch": "the batch grows",
    "leak": "a leak",
    "fragmentation": "fragmentation",
    "another_process": "another process holds the GPU",
    "outside_pytorch": "memory outside PyTorch in this process",
    "too_big": "the step does not fit",
}


def out_of_memory(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    for agent in gpu.agents:
        p = agent.pressure
        recent = p.ooms_recent if p.ooms_recent is not None else p.ooms
        if recent <= 0:
            continue
        when = (
            f"in the last {format_duration(p.window_s)}"
            if p.ooms_recent is not None and p.window_s
            else "since the trainer started"
        )
        report = agent.last_oom
        verdict = report.get("diagnosis") if report else None
        if report and isinstance(verdict, dict) and verdict.get("detail"):
            # The flight recorder's report of the newest OOM says why (`memtop oom` explains).
            yield Suggestion(
                rule="oom",
                severity=CRITICAL,
                pid=agent.pid,
                device=agent.index,
                title=(
                    f"Out of memory at step {report.get('step')} in {report.get('phase')}: "
                    f"{OOM_CAUSES.get(str(verdict.get('cause')), verdict.get('cause'))}"
                    # The failing request's own line, when the agent saw one (DESIGN §12).
                    + (f" {where}" if (where := stack_phrase(report.get("stack"))) else "")
                ),
                detail=str(verdict["detail"]),
                evidence=(
                    f"{recent} OOM{'s' if recent != 1 else ''} {when}; "
                    f"report: memtop oom {report.get('path') or ''}".rstrip()
                ),
                fix=str(verdict.get("fix") or ""),
            )
            continue
        growth = agent.oom_growth
        if growth is not None:
            # No report, but the step marks and the OOM counter show a batch that outgrows
            # the GPU (memtop.oom.diagnose judges it as it judges a report).
            yield Suggestion(
                rule="oom",
                severity=CRITICAL,
                pid=agent.pid,
                device=agent.index,
                title=(
                    f"{recent} out-of-memory error{'s' if recent != 1 else ''} {when}: "
                    f"{OOM_CAUSES['growing_batch']}"
                ),
                detail=str(growth["detail"]),
                evidence=f"num_ooms {p.ooms}, num_alloc_retries {p.retries}; step marks",
                fix=str(growth["fix"]),
            )
            continue
        yield Suggestion(
            rule="oom",
            severity=CRITICAL,
            pid=agent.pid,
            device=agent.index,
            title=f"{recent} out-of-memory error{'s' if recent != 1 else ''} {when}",
            detail=(
                "The allocator ran out even after freeing its cache; batches were lost. "
                "See the usage, leak and fragmentation findings for why."
            ),
            evidence=f"num_ooms {p.ooms}, num_alloc_retries {p.retries}",
        )


def _fragmented(agent: DeviceDiagnosis, held: bool) -> bool:
    frag = agent.fragmentation
    # One or two readings are a moment of the step (the gauge peaks right after a step frees
    # its activations), not fragmentation that lasts: `--once` right after its first round,
    # or a dashboard's first seconds, must not call it.
    return (
        frag.samples >= FRAGMENTATION_MIN_SAMPLES
        and _at_least(frag.gauge_smoothed, FRAGMENTATION_GAUGE, held)
        and _at_least(frag.inactive_split_bytes, FRAGMENTATION_MIN_BYTES, held)
    )


def expandable_segments_vetoed(agent: DeviceDiagnosis) -> str | None:
    """Why expandable segments are not this trainer's fix, whatever the gauge says."""
    conf = agent.allocator_conf
    if has_expandable_segments(conf) or uses_async_backend(conf):
        return "the trainer has them (or the async allocator) already"
    oom = agent.last_oom or {}
    grows = (oom.get("diagnosis") or {}).get("cause") == "growing_batch" or (
        agent.oom_growth is not None
    )
    if grows and not _fragmented(agent, held=False):
        # The retries, and the splits between OOMs, come from a batch that outgrows the GPU
        # and halves: the OOM report says so, and expandable segments would not stop it.
        return "its OOMs come from a growing batch"
    return None


# On ROCm: torch's ROCm builds read PYTORCH_HIP_ALLOC_CONF (after PYTORCH_ALLOC_CONF and
# PYTORCH_CUDA_ALLOC_CONF, which win when set: c10/core/AllocatorConfig.cpp since torch 2.9,
# c10/cuda/CUDAAllocatorConfig.h under USE_ROCM before), and whether expandable segments are
# honoured is decided when torch is built (PYTORCH_C10_DRIVER_API_SUPPORTED): a build without
# them warns "expandable_segments not supported on this platform" and ignores the option.
ROCM_EXPANDABLE_SEGMENTS = (
    " On ROCm, torch reads PYTORCH_HIP_ALLOC_CONF unless PYTORCH_ALLOC_CONF or "
    "PYTORCH_CUDA_ALLOC_CONF is set; a ROCm build without expandable segments warns "
    '"expandable_segments not supported on this platform" and ignores it.'
)


def alloc_conf_variable(agent: DeviceDiagnosis) -> str:
    """The variable a fix to the allocator's options sets: ROCm's spelling on ROCm."""
    return "PYTORCH_HIP_ALLOC_CONF" if agent.hip is not None else "PYTORCH_CUDA_ALLOC_CONF"


def expandable_segments(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    """Split segments or allocator retries → expandable_segments:True (not if already set)."""
    for agent in gpu.agents:
        was = ("expandable_segments", agent.pid, agent.index) in held
        if expandable_segments_vetoed(agent):
            continue
        frag = agent.fragmentation
        p = agent.pressure
        retries = p.retries_recent if p.retries_recent is not None else p.retries
        fragmented = _fragmented(agent, was)
        if not fragmented and retries <= 0:
            continue
        conf = agent.allocator_conf
        evidence = [
            f"fragmentation {frag.gauge_smoothed:.2f} "
            f"({format_bytes(frag.inactive_split_bytes)} free inside split segments)"
        ]
        if frag.external is not None:
            evidence.append(f"external fragmentation {frag.external:.2f}")
        if retries > 0:
            evidence.append(f"{retries} allocator retries (cache flushed to satisfy a request)")
        share = gpu.used_share or 0.0
        severity = CRITICAL if retries > 0 and _at_least(share, 0.90, was, share=True) else WARNING
        options = parse_allocator_conf(conf)
        options["expandable_segments"] = "True"
        value = ",".join(f"{k}:{v}" for k, v in options.items())
        detail = (
            "Freed blocks inside partly used segments cannot serve larger requests. "
            "Expandable segments grow one mapping per stream instead, so that space "
            "becomes usable; set it in the trainer's environment and restart it."
        )
        if agent.hip is not None:
            detail += ROCM_EXPANDABLE_SEGMENTS
        yield Suggestion(
            rule="expandable_segments",
            severity=severity,
            pid=agent.pid,
            device=agent.index,
            title=(
                "Allocator retries: use expandable segments"
                if retries > 0
                else f"Fragmentation {frag.gauge_smoothed:.2f}: use expandable segments"
            ),
            detail=detail,
            evidence="; ".join(evidence),
            fix=f"{alloc_conf_variable(agent)}={value}",
            effect_bytes=frag.inactive_split_bytes,
        )


LEAK_CULPRITS = (
    "Usual culprits: a loss or output accumulated with its graph (`total += loss` instead of "
    "`loss.item()`), tensors appended to a list every step, hooks that store tensors, "
    "`backward(retain_graph=True)`, caches keyed by step or shape."
)


LEAK_AT_SITE = (
    "Something keeps what that line returns alive across steps: a list it is appended to, a "
    "running total with its graph (`total += loss`: use `loss.item()`), an output stored for "
    "later (`.detach()` it, or keep it on the CPU)."
)


def _site_dict(site: Any) -> dict[str, Any]:
    return {"file": site.file, "line": site.line, "function": site.function, "text": site.text}


def leak(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    for agent in gpu.agents:
        estimate = agent.leak
        if not estimate.detected:
            continue
        seconds = estimate.seconds_to_full
        if seconds is not None and seconds < 300:
            severity = EMERGENCY
        elif seconds is not None and seconds < 3600:
            severity = CRITICAL
        else:
            severity = WARNING
        if estimate.bytes_per_step is not None:
            rate = f"+{format_bytes(estimate.bytes_per_step)} per step"
            if estimate.bytes_per_second is not None:
                rate += f" ({format_bytes(estimate.bytes_per_second * 60)}/min)"
            since = f"since step {estimate.since:.0f}" if estimate.since is not None else ""
        else:
            rate = f"+{format_bytes((estimate.bytes_per_second or 0) * 60)}/min"
            since = "over time (no steps seen)"
        eta = f", full in ~{format_duration(seconds)}" if seconds is not None else ""
        if estimate.steps_to_full is not None:
            eta += f" ({estimate.steps_to_full} steps)"
        title, detail = f"Leak: {rate}{eta}", LEAK_CULPRITS
        culprit = leaking_site(agent.sites)
        named = site_name(_site_dict(culprit.site)) if culprit is not None else None
        if culprit is not None and named is not None:
            # Stack recording names the line whose blocks stay (DESIGN §12).
            title = f"Leak: blocks from `{named}` outlive their step: {rate} {since}".rstrip()
            detail = (
                f"{format_bytes(culprit.bytes)} in {culprit.blocks} live blocks allocated at "
                f"{named.split(' ', 1)[0]} in {culprit.site.function or '?'}() "
                f"({culprit.old_blocks} of them older than the previous reading). {LEAK_AT_SITE}"
            )
        yield Suggestion(
            rule="leak",
            severity=severity,
            pid=agent.pid,
            device=agent.index,
            title=title,
            detail=detail,
            # The rate is in the title: the evidence says how sure, so a narrow pane that cuts
            # it still shows the confidence and the sample count.
            evidence=(
                f"confidence {100 * estimate.confidence:.1f} % over {estimate.samples} samples; "
                f"the baseline after each step grows {since}"
            ),
            effect_bytes=(
                round(estimate.bytes_per_second * 3600)
                if estimate.bytes_per_second is not None
                else None
            ),
        )


def eight_bit_optimizer(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    for agent in gpu.agents:
        was = ("8bit_optimizer", agent.pid, agent.index) in held
        state = (agent.breakdown or {}).get("optimizer_state", 0)
        peak = agent.peak_bytes
        if peak <= 0 or not _at_least(state, max(BIG_ENOUGH, OPTIMIZER_SHARE * peak), was):
            continue
        saving = state * 3 // 4  # fp32 moments (4 bytes) → 8-bit (1 byte)
        yield Suggestion(
            rule="8bit_optimizer",
            severity=INFO,
            pid=agent.pid,
            device=agent.index,
            title=f"Optimizer state is {_pct(state / agent.peak_bytes)} of the peak",
            detail=(
                f"An 8-bit optimizer keeps its moments in one byte instead of four: about "
                f"{format_bytes(saving)} less, if the state is fp32 (Adam's usually is)."
            ),
            evidence=f"optimizer state {format_bytes(state)}, peak {format_bytes(peak)}",
            fix="optimizer = bitsandbytes.optim.AdamW8bit(model.parameters(), lr=lr)",
            effect_bytes=saving,
        )


def bf16_parameters(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    for agent in gpu.agents:
        was = ("bf16_parameters", agent.pid, agent.index) in held
        breakdown = agent.breakdown or {}
        fp32 = breakdown.get("fp32_parameter_bytes", 0)
        limit = max(BIG_ENOUGH, FP32_SHARE * agent.peak_bytes)
        if agent.peak_bytes <= 0 or not _at_least(fp32, limit, was):
            continue
        # Weights halve; their gradients, when they exist at the peak, halve with them.
        saving = fp32 // 2 + min(breakdown.get("gradients", 0), fp32) // 2
        yield Suggestion(
            rule="bf16_parameters",
            severity=INFO,
            pid=agent.pid,
            device=agent.index,
            title=f"{format_bytes(fp32)} of parameters are fp32",
            detail=(
                f"bf16 weights (and gradients) take half: about {format_bytes(saving)} less. "
                "Keep fp32 master weights in the optimizer if the model needs them."
            ),
            evidence=(
                f"fp32 parameters {format_bytes(fp32)} of "
                f"{format_bytes(breakdown.get('parameters', 0))}"
            ),
            fix="model.to(torch.bfloat16)",
            effect_bytes=saving,
        )


def gradient_checkpointing(
    gpu: GpuFacts, held: Container[Key] = NOTHING_HELD
) -> Iterable[Suggestion]:
    share_used = gpu.used_share or 0.0
    for agent in gpu.agents:
        was = ("gradient_checkpointing", agent.pid, agent.index) in held
        breakdown = agent.breakdown
        if breakdown is None or agent.peak_bytes <= 0:
            continue
        retries = agent.pressure.retries_recent or 0
        if not _at_least(share_used, TIGHT_USAGE, was, share=True) and retries <= 0:
            continue  # memory is not short: recomputation would only cost time
        static = breakdown.get("parameters", 0) + breakdown.get("optimizer_state", 0)
        activations = agent.peak_bytes - static
        limit = max(BIG_ENOUGH, ACTIVATION_SHARE * agent.peak_bytes)
        if not _at_least(activations, limit, was):
            continue
        # Checkpointing every block keeps one input per block instead of all its
        # intermediates; two thirds of the activations is a typical saving.
        saving = activations * 2 // 3
        yield Suggestion(
            rule="gradient_checkpointing",
            severity=WARNING if _at_least(share_used, 0.85, was, share=True) else INFO,
            pid=agent.pid,
            device=agent.index,
            title=f"Activations are {_pct(activations / agent.peak_bytes)} of the peak",
            detail=(
                f"Gradient checkpointing recomputes them in backward (~30 % more compute): "
                f"typically about {format_bytes(saving)} less at the peak."
            ),
            evidence=(
                f"peak {format_bytes(agent.peak_bytes)} = parameters and optimizer state "
                f"{format_bytes(static)} + activations and gradients {format_bytes(activations)}"
            ),
            fix="torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
            effect_bytes=saving,
        )


def cleanup_for_neighbour(
    gpu: GpuFacts, held: Container[Key] = NOTHING_HELD
) -> Iterable[Suggestion]:
    """Cache one process holds while another on the same GPU is short → cleanup."""
    if gpu.process_count < 2:
        return
    short = [
        a
        for a in gpu.agents
        if (a.pressure.retries_recent or 0) > 0 or (a.pressure.ooms_recent or 0) > 0
    ]
    any_held = any(("cleanup", a.pid, a.index) in held for a in gpu.agents)
    device_short = _at_least(gpu.used_share or 0.0, 0.90, any_held, share=True)
    if not short and not device_short:
        return
    for agent in gpu.agents:
        was = ("cleanup", agent.pid, agent.index) in held
        others = [a for a in short if a.pid != agent.pid]
        if short and not others:
            continue  # only this process is short: its own cache is already available to it
        if not _at_least(agent.releasable_bytes, CLEANUP_MIN_BYTES, was):
            continue
        who = f"pid {others[0].pid}" if others else "other processes"
        yield Suggestion(
            rule="cleanup",
            severity=WARNING,
            pid=agent.pid,
            device=agent.index,
            title=f"pid {agent.pid} caches {format_bytes(agent.releasable_bytes)} {who} could use",
            detail=(
                "Cached memory is reusable only by the process that holds it. Cleanup runs "
                "gc and empty_cache in the trainer at its next step boundary (c in the dashboard)."
            ),
            evidence=(
                f"reserved {format_bytes(agent.reserved_bytes)}, allocated "
                f"{format_bytes(agent.allocated_bytes)}; GPU {gpu.index} at "
                f"{_pct(gpu.used_share or 0.0)}"
            ),
            fix=f"memtop cleanup {agent.pid}",
            effect_bytes=agent.releasable_bytes,
        )


def bigger_batch_vetoed(agent: DeviceDiagnosis) -> str | None:
    """Why there is no room for a bigger batch, whatever the moment's usage says."""
    p = agent.pressure
    if (p.ooms_recent if p.ooms_recent is not None else p.ooms) > 0:
        return "it ran out of memory lately"
    if agent.leak.detected:
        return "it leaks"
    return None


def bigger_batch(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    share = gpu.used_share
    if share is None or gpu.process_count != 1 or len(gpu.agents) != 1:
        return
    agent = gpu.agents[0]
    was = ("bigger_batch", agent.pid, agent.index) in held
    if not _below(share, ROOMY_USAGE, was, share=True):
        return
    transient = agent.transient_bytes
    if bigger_batch_vetoed(agent) or transient is None or transient < 64 * MiB:
        return
    free = gpu.total_bytes - (gpu.used_bytes or 0)
    # The room at the step's peak, not at this sample's moment: between peaks the transient's
    # memory waits in the cache, so the cache of the moment counted it twice (the batch factor
    # came out too large, and the headroom jumped by up to the transient from one sample to
    # the next).  At the peak, what the cache holds beyond the peak is all that is spare.  (The
    # split blocks of the moment are not taken off: their share moves within a step too.)
    cache_at_peak = max(0, agent.reserved_bytes - agent.peak_bytes)
    safety = int(SAFETY_SHARE * gpu.total_bytes)
    headroom = free + cache_at_peak - safety
    # How many times this batch fits: `memtop estimate --from`'s model of the step (one home),
    # where the cache's overhead above the peak grows with the transient (a batch twice as
    # large strands twice the cached blocks), not a fixed spare.
    model = BatchModel.fit(
        1, agent.peak_bytes, agent.reserved_bytes, agent.baseline_bytes or agent.peak_bytes
    )
    factor = model.factor(agent.reserved_bytes + free - safety)
    if not _at_least(factor - 1, BATCH_FACTOR_MIN - 1, was):
        return
    yield Suggestion(
        rule="bigger_batch",
        severity=INFO,
        pid=agent.pid,
        device=agent.index,
        title=f"Room for a batch about {factor:.1f}× larger",
        detail=(
            f"Each step adds {format_bytes(transient)} on top of its baseline; "
            f"{format_bytes(headroom)} is free (keeping {_pct(SAFETY_SHARE)} spare), if "
            "activations grow with the batch."
        ),
        evidence=(
            f"peak {format_bytes(agent.peak_bytes)}, baseline "
            f"{format_bytes(agent.baseline_bytes)}, GPU {gpu.index} at {_pct(share)}"
        ),
        effect_bytes=headroom,
    )


# What ends a suggestion at once, not after its minimum time on screen (see
# memtop.diagnosis.stability): an event that contradicts it, where the dwell is for a measure
# hovering at a line.  "Room for a bigger batch" must not stay up for a minute after an OOM.
VETOES: dict[str, Callable[[DeviceDiagnosis], str | None]] = {
    "expandable_segments": expandable_segments_vetoed,
    "bigger_batch": bigger_batch_vetoed,
}

RANK_DRIFT_SHARE = 0.15  # a rank's peak above the median of its job's other ranks ...
RANK_DRIFT_MIN_BYTES = 1 << 30  # ... and by at least this much
# The usual causes, most common first (the rank-0 OOM is the classic multi-GPU report).
RANK_DRIFT_CAUSES = (
    "rank 0 doing extra work: evaluation, logging or metrics on gathered tensors, or gathering "
    "a full state dict for a checkpoint (save with a sharded/distributed checkpoint, or offload "
    "the gather to CPU); uneven sequence lengths across ranks (bucket or pack by length); an "
    "unbalanced pipeline stage (move layers off this stage)"
)


def rank_drift(gpu: GpuFacts, held: Container[Key] = NOTHING_HELD) -> Iterable[Suggestion]:
    """A rank whose true peak exceeds the median of its job's other ranks by more than 15 %
    and 1 GiB: the rank that OOMs first."""
    for agent in gpu.agents:
        median = agent.peers_median_peak_bytes
        if median is None or median <= 0 or agent.peer_ranks < 1:
            continue
        is_held = ("rank_drift", agent.pid, agent.index) in held
        excess = agent.peak_bytes - median
        share = excess / median
        if not (
            _at_least(share, RANK_DRIFT_SHARE, is_held, share=True)
            and _at_least(excess, RANK_DRIFT_MIN_BYTES, is_held)
        ):
            continue
        who = f"Rank {agent.rank}" if agent.rank is not None else f"pid {agent.pid}"
        phase = (agent.last_oom or {}).get("phase")
        where = f"; its last OOM was in phase {phase!r}" if isinstance(phase, str) else ""
        yield Suggestion(
            rule="rank_drift",
            severity=WARNING,
            pid=agent.pid,
            device=agent.index,
            title=f"{who} peaks {_pct(share)} above its job's other ranks",
            detail=f"Usual causes, most likely first: {RANK_DRIFT_CAUSES}{where}.",
            evidence=(
                f"peak {format_bytes(agent.peak_bytes)} vs median {format_bytes(median)} of "
                f"{agent.peer_ranks} other rank{'s' if agent.peer_ranks != 1 else ''}"
                + (f" of {agent.job}" if agent.job else "")
            ),
            effect_bytes=excess,
        )


RULES: tuple[Rule, ...] = (
    usage,
    out_of_memory,
    leak,
    rank_drift,
    expandable_segments,
    cleanup_for_neighbour,
    gradient_checkpointing,
    eight_bit_optimizer,
    bf16_parameters,
    bigger_batch,
)


def suggest(
    gpus: Iterable[GpuFacts],
    rules: Iterable[Rule] = RULES,
    held: Container[Key] = NOTHING_HELD,
) -> list[Suggestion]:
    """Every rule over every GPU, most severe first.  `held`: the suggestions on screen now,
    judged against their exit limits (hysteresis)."""
    rules = tuple(rules)
    found = [s for gpu in gpus for rule in rules for s in rule(gpu, held=held)]
    return sorted(found, key=lambda s: (-Severity(s.severity).rank, s.pid or 0, s.device or 0))
