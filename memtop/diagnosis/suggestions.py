"""The suggestions engine: rules that turn the diagnosis into what to do, with the evidence and
the effect in bytes where it can be known (DESIGN §5).

Every rule is a function of the facts about one GPU (`GpuObservation`, with the diagnosis of
each agent device on it) returning zero or more suggestions.  Rules never suggest what the trainer
already has: the allocator settings are read from the trainer's own environment through its
agent.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import replace
from typing import Any

from memtop.base.records import record
from memtop.base.user_frame import site_name, stack_phrase
from memtop.diagnosis.facts import (
    DeviceDiagnosis,
    GpuObservation,
    HostDiagnosis,
    has_expandable_segments,
    parse_allocator_conf,
    uses_async_backend,
)
from memtop.diagnosis.sites import leaking_site
from memtop.diagnosis.workload import BudgetBasis, Workload
from memtop.estimate.calibrate import BatchModel
from memtop.figures.units import MiB, format_bytes, format_duration
from memtop.model import SOURCE_AGENT, Choice, DeviceReading, Severity

INFO, WARNING, CRITICAL, EMERGENCY = (
    Severity.INFO,
    Severity.WARNING,
    Severity.CRITICAL,
    Severity.EMERGENCY,
)
SEVERITIES = tuple(Severity)  # in rising order
# Each severity's rank (Severity.rank: 0 for info … 3 for emergency), by the severity or its
# plain string (a str enum hashes as its string): the sorts of every suggestion each round
# read it here rather than through the enum's own lookup, four times dearer.
SEVERITY_RANK: dict[str, int] = {severity: severity.rank for severity in SEVERITIES}

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
# The lowest share at which the usage rule can fire: its lowest level's exit limit, worked out
# as `_at_least` works it out for a held suggestion (the same float).
_USAGE_EXIT = min(limit for limit, _ in USAGE_LEVELS) - HOLD_SHARE

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


class RuleId(Choice):
    """Every rule's id: the JSON's `rule`, the exporter's `rule` label, the key on screen."""

    USAGE = "usage"
    OOM = "oom"
    LEAK = "leak"
    RANK_DRIFT = "rank_drift"
    EXPANDABLE_SEGMENTS = "expandable_segments"
    CLEANUP = "cleanup"
    GRADIENT_CHECKPOINTING = "gradient_checkpointing"
    EIGHT_BIT_OPTIMIZER = "8bit_optimizer"
    BF16_PARAMETERS = "bf16_parameters"
    BIGGER_BATCH = "bigger_batch"
    HOST_LEAK = "host_leak"  # a CPU trainer's RSS after each step grows


class EffectKind(Choice):
    """What a suggestion's `effect_bytes` is, which decides its colour on screen and whether a
    folded line may add it up with others."""

    SAVING = "saving"  # memory the fix would stop using (green); savings add up
    GROWTH = "growth"  # a leak's growth (red)
    EXCESS = "excess"  # memory over a line (yellow)
    ROOM = "room"  # memory not used yet (cyan): never summed with savings


@record(frozen=True, slots=True)
class Suggestion:
    """One finding of the rules for one process or GPU: what, how severe, its evidence, and
    what to do."""

    rule: str  # a RuleId (a str enum): plain strings from a test or a recording compare equal
    severity: Severity
    pid: int | None
    device: int | None  # the agent's device index (the NVML index for GPU-wide findings)
    title: str
    detail: str
    evidence: str
    fix: str | None = None  # one line a user can copy
    effect_bytes: int | None = None  # bytes saved / freed / made usable, when known
    # An OOM report's fix is the agent's words (a trainer wrote the report), and most are
    # advice in prose ("cap the batch at about 80 % ..."), not a line to paste into a shell.
    fix_by_agent: bool = False
    fix_is_prose: bool = False

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
            # What `fix` is: a command or setting ("command") or advice in words ("prose"),
            # and whose words ("memtop", or "agent": from a trainer's OOM report).
            "fix_kind": None if not self.fix else "prose" if self.fix_is_prose else "command",
            "fix_by": None if not self.fix else "agent" if self.fix_by_agent else "memtop",
        }

    @property
    def key(self) -> Key:
        return (self.rule, self.pid, self.device)

    # -- its rule's words (the view asks these; it keeps no table by rule of its own)

    @property
    def effect_kind(self) -> EffectKind:
        rule = RULES_BY_ID.get(self.rule)
        return rule.effect_kind if rule is not None else EffectKind.SAVING

    @property
    def effect_text(self) -> str | None:
        """The effect in words ("saves 9.0 GiB", "+280.0 GiB/hour"); None without one."""
        if not self.effect_bytes:
            return None
        rule = RULES_BY_ID.get(self.rule)
        words = rule.effect_words if rule is not None else SAVES
        return words.format(format_bytes(self.effect_bytes))

    @property
    def short_title(self) -> str:
        """Its name among others in one folded line ("8-bit optimizer, bf16 weights")."""
        rule = RULES_BY_ID.get(self.rule)
        short = rule.short_title if rule is not None else None
        return short or self.title.split(":")[0]


SAVES = "saves {}"


@record(frozen=True, slots=True)
class Finding:
    """What a rule found at one place: a suggestion without its rule, pid and device."""

    severity: Severity
    title: str
    detail: str
    evidence: str
    fix: str | None = None
    effect_bytes: int | None = None
    fix_by_agent: bool = False  # see Suggestion
    fix_is_prose: bool = False


# Whether the suggestion of this rule at (pid, device) is on screen now (hysteresis).
Held = Callable[[int | None, int | None], bool]
# A rule's predicate over one GPU: each (pid, device, finding) it fires at.
Judge = Callable[[GpuObservation, Held], Iterable[tuple[int | None, int | None, Finding]]]
# ... or over one agent device on it (most rules): a finding or None, told whether it is held.
AgentJudge = Callable[[DeviceDiagnosis, GpuObservation, bool], Finding | None]


class PerAgent:
    """A rule's predicate judged on each agent device of the GPU on its own (a `Judge`);
    `suggest` calls its `judge` on each device straight, without a generator per GPU and rule
    (eight of the eleven rules are of this kind: 8 GPUs × 11 rules a round in the `mixed` demo)."""

    __slots__ = ("judge",)

    def __init__(self, judge: AgentJudge) -> None:
        self.judge = judge

    def __call__(
        self, gpu: GpuObservation, held: Held
    ) -> Iterator[tuple[int | None, int | None, Finding]]:
        for agent in gpu.agents:
            found = self.judge(agent, gpu, held(agent.pid, agent.index))
            if found is not None:
                yield agent.pid, agent.index, found


def per_agent(judge: AgentJudge) -> Judge:
    """A rule judged on each agent device of the GPU on its own."""
    return PerAgent(judge)


@record(frozen=True, slots=True)
class Rule:
    """One suggestion rule: its id, its predicate, and the words the view says it in.  A new
    rule is one record here (and in RULES), plus its tests."""

    id: RuleId
    judge: Judge
    effect_words: str = SAVES  # the effect in words: `{}` is its size
    effect_kind: EffectKind = EffectKind.SAVING
    short_title: str | None = None  # its name in a folded line; None: its title up to ":"
    # What ends its suggestion at once, not after its minimum time on screen (see
    # memtop.diagnosis.stability): an event that contradicts it, where the dwell is for a
    # measure hovering at a line.  "Room for a bigger batch" must not stay up after an OOM.
    veto: Callable[[DeviceDiagnosis], str | None] | None = None

    def __call__(
        self, gpu: GpuObservation, held: Container[Key] = NOTHING_HELD
    ) -> Iterator[Suggestion]:
        """Its suggestions on one GPU; `held`: the keys of the suggestions on screen now."""

        def is_held(pid: int | None, device: int | None) -> bool:
            return (self.id, pid, device) in held

        for pid, device, f in self.judge(gpu, is_held):
            yield self.suggestion(pid, device, f)

    def suggestion(self, pid: int | None, device: int | None, f: Finding) -> Suggestion:
        """Its suggestion of finding `f` at (pid, device)."""
        return Suggestion(
            self.id,
            f.severity,
            pid,
            device,
            f.title,
            f.detail,
            f.evidence,
            f.fix,
            f.effect_bytes,
            f.fix_by_agent,
            f.fix_is_prose,
        )


def _pct(share: float) -> str:
    return f"{100 * share:.1f} %"


def _heaviest(gpu: GpuObservation) -> DeviceDiagnosis | None:
    return max(gpu.agents, key=lambda a: a.reserved_bytes, default=None)


# ------------------------------------------------------------------------------ the rules


def _usage(gpu: GpuObservation, held: Held) -> Iterator[tuple[int | None, int | None, Finding]]:
    """85 % warning, 90 % critical, 95 % emergency of the device's memory in use; info when the
    usage is what an inference server or a preallocator on it asked for (_own_request)."""
    share = gpu.used_share
    if share is None or gpu.used_bytes is None:
        return
    if share < _USAGE_EXIT:
        return  # under every level's limit, held or not: who would be named is not asked
    heaviest = _heaviest(gpu)
    asking = _preallocators(gpu)
    pid: int | None
    device: int | None
    if asking:
        pid, device = asking[0][0], (asking[0][2].index if asking[0][2] else gpu.index)
    else:
        pid, device = (heaviest.pid, heaviest.index) if heaviest else (None, gpu.index)
    was = held(pid, device)
    severity = next(
        (level for limit, level in USAGE_LEVELS if _at_least(share, limit, was, share=True)), None
    )
    if severity is None:
        return
    evidence = f"{format_bytes(gpu.used_bytes)} of {format_bytes(gpu.judged_total_bytes)} used"
    if asking:
        within = _own_request(gpu, share, asking)
        yield pid, device, _server_usage(gpu, share, severity, asking, within, evidence)
        return
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
    elif heaviest is not None and not heaviest.trains:
        detail = (
            f"pid {heaviest.pid} has not stepped (not a training loop): what it keeps allocated "
            "is its own; lower what it loads or caches, or move other processes off this GPU."
        )
        fix = None
    else:
        detail = (
            "The next larger batch or sequence may not fit: lower the batch size or sequence "
            "length, or act on the other suggestions."
        )
        fix = None
    yield (
        pid,
        device,
        Finding(
            severity=severity,
            title=f"GPU {gpu.index} memory at {_pct(share)}",
            detail=detail,
            evidence=evidence,
            fix=fix,
            effect_bytes=max(0, gpu.used_bytes - int(0.85 * gpu.judged_total_bytes)),
        ),
    )


# What a server or a preallocator may hold beyond its share and still be within its request:
# a CUDA context, NCCL's buffers and the like, which vLLM's own share includes only roughly.
OWN_REQUEST_TOLERANCE = 0.03

Asking = tuple[int, Workload, DeviceDiagnosis | None]  # (pid, what it is, its agent device)


def _preallocators(gpu: GpuObservation) -> list[Asking]:
    """The processes on the GPU that asked for a share of it on purpose, largest first."""
    found: list[Asking] = [
        (a.pid, a.workload, a)
        for a in gpu.agents
        if a.workload is not None and a.workload.preallocates
    ]
    found += [(pid, w, None) for pid, w in gpu.workloads.items() if w.preallocates]
    return sorted(found, key=lambda x: -(x[1].budget_share or 0.0))


def _asked_share(workload: Workload) -> float:
    """The most of the GPU its setting lets it take: its share of the total; for a share of the
    memory free after its weights (TensorRT-LLM), up to all of it."""
    if workload.basis == BudgetBasis.FREE:
        return 1.0
    return workload.budget_share or 0.0


def _trouble(agent: DeviceDiagnosis | None) -> str | None:
    """What says a preallocator is short of its own share: retries, OOMs, growth."""
    if agent is None:
        return None
    p = agent.pressure
    ooms = p.ooms_recent if p.ooms_recent is not None else p.ooms
    retries = p.retries_recent if p.retries_recent is not None else p.retries
    if ooms:
        return f"{ooms} out-of-memory error{'s' if ooms != 1 else ''}"
    if retries:
        return f"{retries} allocation retr{'ies' if retries != 1 else 'y'} (cache flushed)"
    if agent.leak.detected:
        return "its memory grows"
    return None


def _own_request(gpu: GpuObservation, share: float, asking: list[Asking]) -> bool:
    """Whether the GPU's usage is what its preallocators asked for: no more than the sum of
    their shares (and a context each), and none of them retrying, out of memory or growing."""
    asked = sum(_asked_share(w) for _, w, _ in asking)
    if share > asked + OWN_REQUEST_TOLERANCE:
        return False
    return all(_trouble(agent) is None for _, _, agent in asking)


def _server_usage(
    gpu: GpuObservation,
    share: float,
    severity: Severity,
    asking: list[Asking],
    within: bool,
    evidence: str,
) -> Finding:
    pid, workload, agent = asking[0]
    what = workload.label or "a preallocating process"
    setting = workload.setting or "its own sizing"
    evidence += "; " + ", ".join(
        f"pid {p} {w.label} ({w.setting or w.source})" for p, w, _ in asking
    )
    if within:
        seen = "flat, no retries or OOMs" if agent is not None else "retries not visible: no agent"
        return Finding(
            severity=INFO,
            title=f"GPU {gpu.index} at {_pct(share)}: {what}, reserved on purpose",
            detail=(
                f"pid {pid} takes its share when it starts ({setting}) for its weights and "
                "cache, and keeps it: usage within its own request is not pressure. To leave "
                f"room for other processes on this GPU, start it with a lower {_flag_of(setting)}."
            ),
            evidence=f"{evidence}; {seen}",
        )
    trouble = _trouble(agent)
    asked = sum(_asked_share(w) for _, w, _ in asking)
    beyond = (
        f"the GPU is at {_pct(share)}, beyond the {asked:.2f} it asked for"
        if share > asked + OWN_REQUEST_TOLERANCE
        else f"within the {asked:.2f} it asked for, but with {trouble}"
    )
    return Finding(
        severity=severity,
        title=f"GPU {gpu.index} memory at {_pct(share)}: {what} past its request",
        detail=(
            f"pid {pid} asked for its share ({setting}) and {beyond}. Something beyond its "
            f"request holds memory: another process on this GPU, or the engine itself outside "
            f"its pool; lower {_flag_of(setting)} or move the other processes."
        ),
        evidence=evidence + (f"; {trouble}" if trouble else ""),
        effect_bytes=max(0, (gpu.used_bytes or 0) - int(min(1.0, asked) * gpu.judged_total_bytes)),
    )


def _flag_of(setting: str) -> str:
    """The flag or variable of a setting ("--gpu-memory-utilization 0.92" → the flag)."""
    return setting.split(" ", 1)[0].split("=", 1)[0] or setting


# The causes of memtop.oom.diagnose, as a suggestion's title says them.
OOM_CAUSES = {
    "growing_batch": "the batch grows",
    "leak": "a leak",
    "fragmentation": "fragmentation",
    "another_process": "another process holds the GPU",
    "outside_pytorch": "memory outside PyTorch in this process",
    "unknown_holder": "memory outside PyTorch, whose is not known",
    "too_big": "the step does not fit",
}


def _out_of_memory(agent: DeviceDiagnosis, gpu: GpuObservation, held: bool) -> Finding | None:
    p = agent.pressure
    recent = p.ooms_recent if p.ooms_recent is not None else p.ooms
    if recent <= 0:
        return None
    when = (
        f"in the last {format_duration(p.window_s)}"
        if p.ooms_recent is not None and p.window_s
        else "since the trainer started"
    )
    report = agent.last_oom
    verdict = report.get("diagnosis") if report else None
    if report and isinstance(verdict, dict) and verdict.get("detail"):
        # The flight recorder's report of the newest OOM says why (`memtop oom` explains).
        return Finding(
            severity=CRITICAL,
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
            fix_by_agent=True,
            fix_is_prose=not is_setting(str(verdict.get("fix") or "")),
        )
    growth = agent.oom_growth
    if growth is not None:
        # No report, but the step marks and the OOM counter show a batch that outgrows the
        # GPU (memtop.oom.diagnose judges it as it judges a report).
        return Finding(
            severity=CRITICAL,
            title=(
                f"{recent} out-of-memory error{'s' if recent != 1 else ''} {when}: "
                f"{OOM_CAUSES['growing_batch']}"
            ),
            detail=str(growth["detail"]),
            evidence=f"num_ooms {p.ooms}, num_alloc_retries {p.retries}; step marks",
            fix=str(growth["fix"]),
            fix_is_prose=not is_setting(str(growth["fix"])),
        )
    return Finding(
        severity=CRITICAL,
        title=f"{recent} out-of-memory error{'s' if recent != 1 else ''} {when}",
        detail=(
            "The allocator ran out even after freeing its cache; batches were lost. "
            "See the usage, leak and fragmentation findings for why."
        ),
        evidence=f"num_ooms {p.ooms}, num_alloc_retries {p.retries}",
    )


# `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: the one kind of OOM fix that is a line to
# paste (memtop.oom.diagnose words every other as advice).
_SETTING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S+")


def is_setting(fix: str) -> bool:
    """Whether an OOM verdict's fix is an environment setting (NAME=value, no space in it)
    rather than advice in words."""
    return _SETTING.fullmatch(fix) is not None


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


def _expandable_segments(agent: DeviceDiagnosis, gpu: GpuObservation, was: bool) -> Finding | None:
    """Split segments or allocator retries → expandable_segments:True (not if already set)."""
    frag = agent.fragmentation
    p = agent.pressure
    retries = p.retries_recent if p.retries_recent is not None else p.retries
    fragmented = _fragmented(agent, was)
    if not fragmented and retries <= 0:
        return None  # nothing to fix: the veto (the allocator's options parsed twice) unasked
    if expandable_segments_vetoed(agent):
        return None
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
        "becomes usable; set it in the trainer's environment and restart it, or apply it "
        f"to the running trainer: `memtop tune {agent.pid} expandable_segments=True` (key e; "
        "segments already cached keep their kind)."
    )
    if agent.hip is not None:
        detail += ROCM_EXPANDABLE_SEGMENTS
    return Finding(
        severity=severity,
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


LEAK_WITHOUT_STACKS = (
    "Which line it is, memtop cannot tell without stack recording (off): press w on the "
    "process (or run it with MEMTOP_STACKS=1) and the line whose blocks outlive their step is "
    "named."
)


LEAK_AT_SITE = (
    "Something keeps what that line returns alive across steps: a list it is appended to, a "
    "running total with its graph (`total += loss`: use `loss.item()`), an output stored for "
    "later (`.detach()` it, or keep it on the CPU)."
)


def _site_dict(site: Any) -> dict[str, Any]:
    return {"file": site.file, "line": site.line, "function": site.function, "text": site.text}


def _leak(agent: DeviceDiagnosis, gpu: GpuObservation, held: bool) -> Finding | None:
    estimate = agent.leak
    if not estimate.detected:
        return None
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
    if not agent.sites:
        # Which of those it is rests on a reading memtop does not have: say which and how.
        detail = f"{LEAK_CULPRITS} {LEAK_WITHOUT_STACKS}"
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
    return Finding(
        severity=severity,
        title=title,
        detail=detail,
        # The rate is in the title: the evidence says how sure, so a narrow pane that cuts it
        # still shows the confidence and the sample count.
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


# The tips judged on a trainer's breakdown and its true peak (8-bit optimizer, bf16 weights) are
# judged on those figures alone, passed in: each is a pure function of its arguments, worked
# out once per distinct set of them.  A breakdown is measured once in a while and torch's
# peak moves only when a step goes higher, so these tips (20 of the 31 suggestions in the
# `mixed` demo) were worded anew, to the same words, every round.  `typed`: an int and a
# float of one value word their bytes alike but not their effect (5 against 5.0 in the JSON).
_judged_once = functools.lru_cache(maxsize=256, typed=True)


def _eight_bit_optimizer(agent: DeviceDiagnosis, gpu: GpuObservation, was: bool) -> Finding | None:
    if not agent.trains:
        return None  # a server or a loop without steps has no optimizer state to shrink
    return _eight_bit_finding(
        (agent.breakdown or {}).get("optimizer_state", 0), agent.peak_bytes, was
    )


@_judged_once
def _eight_bit_finding(state: int, peak: int, was: bool) -> Finding | None:
    if peak <= 0 or not _at_least(state, max(BIG_ENOUGH, OPTIMIZER_SHARE * peak), was):
        return None
    saving = state * 3 // 4  # fp32 moments (4 bytes) → 8-bit (1 byte)
    return Finding(
        severity=INFO,
        title=f"Optimizer state is {_pct(state / peak)} of the peak",
        detail=(
            f"An 8-bit optimizer keeps its moments in one byte instead of four: about "
            f"{format_bytes(saving)} less, if the state is fp32 (Adam's usually is)."
        ),
        evidence=f"optimizer state {format_bytes(state)}, peak {format_bytes(peak)}",
        fix="optimizer = bitsandbytes.optim.AdamW8bit(model.parameters(), lr=lr)",
        effect_bytes=saving,
    )


def _bf16_parameters(agent: DeviceDiagnosis, gpu: GpuObservation, was: bool) -> Finding | None:
    breakdown = agent.breakdown or {}
    return _bf16_finding(
        breakdown.get("fp32_parameter_bytes", 0),
        breakdown.get("gradients", 0),
        breakdown.get("parameters", 0),
        agent.peak_bytes,
        was,
    )


@_judged_once
def _bf16_finding(
    fp32: int, gradients: int, parameters: int, peak: int, was: bool
) -> Finding | None:
    limit = max(BIG_ENOUGH, FP32_SHARE * peak)
    if peak <= 0 or not _at_least(fp32, limit, was):
        return None
    # Weights halve; their gradients, when they exist at the peak, halve with them.
    saving = fp32 // 2 + min(gradients, fp32) // 2
    return Finding(
        severity=INFO,
        title=f"{format_bytes(fp32)} of parameters are fp32",
        detail=(
            f"bf16 weights (and gradients) take half: about {format_bytes(saving)} less. "
            "Keep fp32 master weights in the optimizer if the model needs them."
        ),
        evidence=(f"fp32 parameters {format_bytes(fp32)} of {format_bytes(parameters)}"),
        fix="model.to(torch.bfloat16)",
        effect_bytes=saving,
    )


def _gradient_checkpointing(
    agent: DeviceDiagnosis, gpu: GpuObservation, was: bool
) -> Finding | None:
    if not agent.trains:
        return None  # no backward pass keeps activations in a server
    share_used = gpu.used_share or 0.0
    breakdown = agent.breakdown
    if breakdown is None or agent.peak_bytes <= 0:
        return None
    retries = agent.pressure.retries_recent or 0
    if not _at_least(share_used, TIGHT_USAGE, was, share=True) and retries <= 0:
        return None  # memory is not short: recomputation would only cost time
    static = breakdown.get("parameters", 0) + breakdown.get("optimizer_state", 0)
    activations = agent.peak_bytes - static
    limit = max(BIG_ENOUGH, ACTIVATION_SHARE * agent.peak_bytes)
    if not _at_least(activations, limit, was):
        return None
    # Checkpointing every block keeps one input per block instead of all its intermediates;
    # two thirds of the activations is a typical saving.
    saving = activations * 2 // 3
    return Finding(
        severity=WARNING if _at_least(share_used, 0.85, was, share=True) else INFO,
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


def _cleanup_for_neighbour(
    gpu: GpuObservation, held: Held
) -> Iterator[tuple[int | None, int | None, Finding]]:
    """Cache one process holds while another on the same GPU is short → cleanup."""
    if gpu.process_count < 2:
        return
    short = [
        a
        for a in gpu.agents
        if (a.pressure.retries_recent or 0) > 0 or (a.pressure.ooms_recent or 0) > 0
    ]
    any_held = any(held(a.pid, a.index) for a in gpu.agents)
    device_short = _at_least(gpu.used_share or 0.0, 0.90, any_held, share=True)
    if not short and not device_short:
        return
    for agent in gpu.agents:
        was = held(agent.pid, agent.index)
        others = [a for a in short if a.pid != agent.pid]
        if short and not others:
            continue  # only this process is short: its own cache is already available to it
        if not _at_least(agent.releasable_bytes, CLEANUP_MIN_BYTES, was):
            continue
        who = f"pid {others[0].pid}" if others else "other processes"
        yield (
            agent.pid,
            agent.index,
            Finding(
                severity=WARNING,
                title=(
                    f"pid {agent.pid} caches {format_bytes(agent.releasable_bytes)} {who} could use"
                ),
                detail=(
                    "Cached memory is reusable only by the process that holds it. Cleanup runs "
                    "gc and empty_cache in the trainer at its next step boundary (c in the "
                    "dashboard)."
                ),
                evidence=(
                    f"reserved {format_bytes(agent.reserved_bytes)}, allocated "
                    f"{format_bytes(agent.allocated_bytes)}; GPU {gpu.index} at "
                    f"{_pct(gpu.used_share or 0.0)}"
                ),
                fix=f"memtop cleanup {agent.pid}",
                effect_bytes=agent.releasable_bytes,
            ),
        )


def bigger_batch_vetoed(agent: DeviceDiagnosis) -> str | None:
    """Why there is no room for a bigger batch, whatever the moment's usage says."""
    p = agent.pressure
    if (p.ooms_recent if p.ooms_recent is not None else p.ooms) > 0:
        return "it ran out of memory lately"
    if agent.leak.detected:
        return "it leaks"
    return None


def _bigger_batch(agent: DeviceDiagnosis, gpu: GpuObservation, was: bool) -> Finding | None:
    if not agent.trains:
        return None  # a server sizes its batches itself; a loop without steps has no batch seen
    share = gpu.used_share
    if share is None or gpu.process_count != 1 or len(gpu.agents) != 1:
        return None  # only a trainer alone on its GPU can count the free memory as its own
    if not _below(share, ROOMY_USAGE, was, share=True):
        return None
    transient = agent.transient_bytes
    if bigger_batch_vetoed(agent) or transient is None or transient < 64 * MiB:
        return None
    return _bigger_batch_finding(
        gpu.index,
        gpu.judged_total_bytes,
        gpu.used_bytes or 0,
        share,
        agent.reserved_bytes,
        agent.peak_bytes,
        agent.baseline_bytes or 0,
        transient,
        was,
    )


@_judged_once
def _bigger_batch_finding(
    gpu_index: int,
    total: int,
    used: int,
    share: float,
    reserved: int,
    peak: int,
    baseline: int,
    transient: int,
    was: bool,
) -> Finding | None:
    """The room for a bigger batch of a trainer alone on its GPU, judged on these figures
    alone (a trainer's peak, baseline and reserved bytes and its GPU's usage hold still for
    many rounds: the same words were made again, and the batch model fitted again, each)."""
    free = total - used
    # The room at the step's peak, not at this sample's moment: between peaks the transient's
    # memory waits in the cache, so the cache of the moment counted it twice (the batch factor
    # came out too large, and the headroom jumped by up to the transient from one sample to
    # the next).  At the peak, what the cache holds beyond the peak is all that is spare.  (The
    # split blocks of the moment are not taken off: their share moves within a step too.)
    cache_at_peak = max(0, reserved - peak)
    safety = int(SAFETY_SHARE * total)
    headroom = free + cache_at_peak - safety
    # How many times this batch fits: `memtop estimate --from`'s model of the step (one home),
    # where the cache's overhead above the peak grows with the transient (a batch twice as
    # large strands twice the cached blocks), not a fixed spare.
    model = BatchModel.fit(1, peak, reserved, baseline or peak)
    factor = model.factor(reserved + free - safety)
    if not _at_least(factor - 1, BATCH_FACTOR_MIN - 1, was):
        return None
    return Finding(
        severity=INFO,
        title=f"Room for a batch about {factor:.1f}× larger",
        detail=(
            f"Each step adds {format_bytes(transient)} on top of its baseline; "
            f"{format_bytes(headroom)} is free (keeping {_pct(SAFETY_SHARE)} spare), if "
            "activations grow with the batch."
        ),
        evidence=(
            f"peak {format_bytes(peak)}, baseline "
            f"{format_bytes(baseline)}, GPU {gpu_index} at {_pct(share)}"
        ),
        effect_bytes=headroom,
    )


RANK_DRIFT_SHARE = 0.15  # a rank's peak above the median of its job's other ranks ...
RANK_DRIFT_MIN_BYTES = 1 << 30  # ... and by at least this much
# The usual causes, most common first (the rank-0 OOM is the classic multi-GPU report).
RANK_DRIFT_CAUSES = (
    "rank 0 doing extra work: evaluation, logging or metrics on gathered tensors, or gathering "
    "a full state dict for a checkpoint (save with a sharded/distributed checkpoint, or offload "
    "the gather to CPU); uneven sequence lengths across ranks (bucket or pack by length); an "
    "unbalanced pipeline stage (move layers off this stage)"
)


def _rank_drift(agent: DeviceDiagnosis, gpu: GpuObservation, is_held: bool) -> Finding | None:
    """A rank whose true peak exceeds the median of its job's other ranks by more than 15 %
    and 1 GiB: the rank that OOMs first."""
    median = agent.peers_median_peak_bytes
    if median is None or median <= 0 or agent.peer_ranks < 1:
        return None
    excess = agent.peak_bytes - median
    share = excess / median
    if not (
        _at_least(share, RANK_DRIFT_SHARE, is_held, share=True)
        and _at_least(excess, RANK_DRIFT_MIN_BYTES, is_held)
    ):
        return None
    who = f"Rank {agent.rank}" if agent.rank is not None else f"pid {agent.pid}"
    phase = (agent.last_oom or {}).get("phase")
    where = f"; its last OOM was in phase {phase!r}" if isinstance(phase, str) else ""
    return Finding(
        severity=WARNING,
        title=f"{who} peaks {_pct(share)} above its job's other ranks",
        detail=f"Usual causes, most likely first: {RANK_DRIFT_CAUSES}{where}.",
        evidence=(
            f"peak {format_bytes(agent.peak_bytes)} vs median {format_bytes(median)} of "
            f"{agent.peer_ranks} other rank{'s' if agent.peer_ranks != 1 else ''}"
            + (f" of {agent.job}" if agent.job else "")
        ),
        effect_bytes=excess,
    )


# ------------------------------------------------------------------------------ the records

usage = Rule(RuleId.USAGE, _usage, effect_words="{} over 85 %", effect_kind=EffectKind.EXCESS)
out_of_memory = Rule(RuleId.OOM, per_agent(_out_of_memory))
leak = Rule(RuleId.LEAK, per_agent(_leak), effect_words="+{}/hour", effect_kind=EffectKind.GROWTH)
rank_drift = Rule(RuleId.RANK_DRIFT, per_agent(_rank_drift))
expandable_segments = Rule(
    RuleId.EXPANDABLE_SEGMENTS,
    per_agent(_expandable_segments),
    effect_words="{} stuck in splits",
    veto=expandable_segments_vetoed,
)
cleanup_for_neighbour = Rule(RuleId.CLEANUP, _cleanup_for_neighbour, effect_words="frees {}")
gradient_checkpointing = Rule(
    RuleId.GRADIENT_CHECKPOINTING, per_agent(_gradient_checkpointing), short_title="checkpointing"
)
eight_bit_optimizer = Rule(
    RuleId.EIGHT_BIT_OPTIMIZER, per_agent(_eight_bit_optimizer), short_title="8-bit optimizer"
)
bf16_parameters = Rule(
    RuleId.BF16_PARAMETERS, per_agent(_bf16_parameters), short_title="bf16 weights"
)
bigger_batch = Rule(
    RuleId.BIGGER_BATCH,
    per_agent(_bigger_batch),
    effect_words="{} unused",
    effect_kind=EffectKind.ROOM,
    short_title="bigger batch",
    veto=bigger_batch_vetoed,
)


def _no_gpu_findings(
    gpu: GpuObservation, held: Held
) -> Iterator[tuple[int | None, int | None, Finding]]:
    """A rule judged on processes, not GPUs (host_leak_suggestions): nothing per GPU."""
    return iter(())


host_leak = Rule(
    RuleId.HOST_LEAK,
    _no_gpu_findings,
    effect_words="+{}/hour",
    effect_kind=EffectKind.GROWTH,
    short_title="host leak",
)

HOST_LEAK_CULPRITS = (
    "Something keeps each step's tensors alive in host memory: a loss or logits kept with "
    "their graph (`losses.append(loss)`: append `loss.item()`, or `.detach()` what you keep), "
    "outputs appended to a list, a cache keyed by step, hooks that store their inputs."
)


def host_leak_suggestions(hosts: Iterable[HostDiagnosis]) -> list[Suggestion]:
    """A CPU trainer whose RSS after each step grows (DESIGN §5's leak, on host memory)."""
    found = []
    for host in hosts:
        estimate = host.leak
        if not estimate.detected:
            continue
        seconds = estimate.seconds_to_full
        severity = (
            EMERGENCY
            if seconds is not None and seconds < 300
            else CRITICAL
            if seconds is not None and seconds < 3600
            else WARNING
        )
        if estimate.bytes_per_step is not None:
            rate = f"+{format_bytes(estimate.bytes_per_step)} per step"
            basis = "the resident set right after each step grows"
        else:
            rate = f"+{format_bytes((estimate.bytes_per_second or 0) * 60)}/min"
            basis = "the lowest resident set over time grows (no steps seen)"
        eta = f", machine full in ~{format_duration(seconds)}" if seconds is not None else ""
        found.append(
            Suggestion(
                RuleId.HOST_LEAK,
                severity,
                host.pid,
                None,
                f"Host memory leak: {rate}{eta}",
                HOST_LEAK_CULPRITS,
                (
                    f"RSS {format_bytes(host.rss_bytes)}; confidence "
                    f"{100 * estimate.confidence:.1f} % over {estimate.samples} samples; {basis}"
                ),
                effect_bytes=(
                    round(estimate.bytes_per_second * 3600)
                    if estimate.bytes_per_second is not None
                    else None
                ),
            )
        )
    return found


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
    host_leak,
)
RULES_BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}
# The vetoes by rule, for memtop.diagnosis.stability (each is its rule record's).
VETOES: dict[str, Callable[[DeviceDiagnosis], str | None]] = {
    rule.id: rule.veto for rule in RULES if rule.veto is not None
}


def suggest(
    gpus: Iterable[GpuObservation],
    rules: Iterable[Rule] = RULES,
    held: Container[Key] = NOTHING_HELD,
    made: dict[Key, tuple[Finding, Suggestion]] | None = None,
) -> list[Suggestion]:
    """Every rule over every GPU, most severe first.  `held`: the suggestions on screen now,
    judged against their exit limits (hysteresis).  `made`: the per-agent rules' suggestions
    of the last call, by key, with the finding each was made of; a rule that returns that same
    finding again (a judgement kept: `_judged_once`) gives that suggestion, not a new record
    equal to it.  Replaced by this call's."""
    rules = tuple(rules)
    found: list[Suggestion] = []
    last = made if made is not None else {}
    now: dict[Key, tuple[Finding, Suggestion]] = {}
    for gpu in gpus:
        for rule in rules:
            judge = rule.judge
            if not isinstance(judge, PerAgent):
                found += rule(gpu, held=held)
                continue
            # What `rule(gpu, held)` yields for a per-agent rule, in the same order.
            for agent in gpu.agents:
                key = (rule.id, agent.pid, agent.index)
                f = judge.judge(agent, gpu, key in held)
                if f is None:
                    continue
                before = last.get(key)
                if before is not None and before[0] is f:
                    suggestion = before[1]
                else:
                    suggestion = rule.suggestion(agent.pid, agent.index, f)
                now[key] = (f, suggestion)
                found.append(suggestion)
    if made is not None:
        made.clear()
        made.update(now)
    return most_severe_first(found)


def most_severe_first(found: Iterable[Suggestion]) -> list[Suggestion]:
    return sorted(found, key=lambda s: (-SEVERITY_RANK[s.severity], s.pid or 0, s.device or 0))


def last_seen_leaks(exited: Iterable[DeviceDiagnosis]) -> list[Suggestion]:
    """The leak verdicts of trainers that have exited, while their rows stay: the leak is still
    the code's to fix (it vanished with the process, the row staying a minute without it).
    Marked as last seen; no time to full and no growth (nothing grows any more), a warning."""
    found = []
    for dev in exited:
        if not dev.leak.detected:
            continue
        stopped = replace(dev, leak=replace(dev.leak, seconds_to_full=None, steps_to_full=None))
        finding = _leak(stopped, _alone(stopped), False)
        if finding is None:
            continue
        title = finding.title.removeprefix("Leak: ")
        found.append(
            Suggestion(
                RuleId.LEAK,
                WARNING,
                dev.pid,
                dev.index,
                f"Leak, last seen before pid {dev.pid} exited: {title}",
                finding.detail,
                finding.evidence,
                finding.fix,
                None,
            )
        )
    return found


def _alone(dev: DeviceDiagnosis) -> GpuObservation:
    """A device judged on its own (an exited trainer's): a GPU of the agent's own account."""
    reading = DeviceReading(dev.index, dev.uuid, "", dev.total_bytes, None, source=SOURCE_AGENT)
    return GpuObservation(reading, (), (dev,))
