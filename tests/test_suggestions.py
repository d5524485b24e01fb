"""Each suggestion rule: facts that must fire it, and facts that must not (DESIGN §5)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from memtop.diagnosis import suggestions as rules
from memtop.diagnosis.facts import DeviceDiagnosis, GpuObservation, parse_allocator_conf
from memtop.diagnosis.fragmentation import Fragmentation, Pressure
from memtop.diagnosis.leak import LeakEstimate, not_enough
from memtop.model import (
    AgentDeviceSample,
    AgentHello,
    AgentStatus,
    AgentView,
    DeviceReading,
    GpuProcess,
)

MiB, GiB = 1 << 20, 1 << 30
TOTAL = 80 * GiB


def frag(gauge: float = 0.0, split: int = 0) -> Fragmentation:
    return Fragmentation(gauge, gauge, split, 10 * GiB, None, None, None, 0, samples=10)


def sample(allocated: int, reserved: int, peak: int, free: int) -> AgentDeviceSample:
    """The sample a diagnosis was judged on (it reads the bytes through it)."""
    stats = {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": peak,
    }
    return AgentDeviceSample(0, stats, free, TOTAL)


def device(
    pid: int = 100,
    allocated: int = 20 * GiB,
    reserved: int = 24 * GiB,
    peak: int = 30 * GiB,
    baseline: int | None = 18 * GiB,
    leak: LeakEstimate | None = None,
    fragmentation: Fragmentation | None = None,
    pressure: Pressure | None = None,
    breakdown: dict[str, int] | None = None,
    conf: str = "",
) -> DeviceDiagnosis:
    return DeviceDiagnosis(
        pid=pid,
        index=0,
        uuid="GPU-1",
        sample=sample(allocated, reserved, peak, free=TOTAL - reserved),
        baseline_bytes=baseline,
        leak=leak or not_enough("no data"),
        fragmentation=fragmentation or frag(),
        pressure=pressure or Pressure(0, 0, 0, 0, 600.0),
        breakdown=breakdown,
        process=process(pid, conf),
    )


def process(
    pid: int = 100, conf: str = "", hip: str | None = None, last_oom: Any = None
) -> AgentView:
    """The agent's record a device reads who it is through: its allocator settings (the
    environment's), its ROCm build, its newest OOM report."""
    hello = AgentHello(1, pid, (), "3.12", "2.5", conf, (), extra={"hip": hip} if hip else {})
    return AgentView(pid, AgentStatus.CONNECTED, hello, last_oom=last_oom)


def told(dev: DeviceDiagnosis, hip: str | None = None, last_oom: Any = None) -> DeviceDiagnosis:
    """`dev` whose process is a ROCm build (`hip`) or reported an OOM on it (`last_oom`)."""
    oom = None if last_oom is None else {**last_oom, "device": dev.index}
    return dataclasses.replace(dev, process=process(dev.pid, dev.allocator_conf, hip, oom))


def gpu(*agents: DeviceDiagnosis, used: int | None = None, processes: Any = None) -> GpuObservation:
    if used is None:
        used = sum(a.reserved_bytes for a in agents) + 500 * MiB
    if processes is None:
        processes = tuple((a.pid, a.reserved_bytes) for a in agents)
    listed = tuple(GpuProcess(pid, charged) for pid, charged in processes)
    reading = DeviceReading(0, "GPU-1", "Sim GPU", TOTAL, used, processes=listed)
    return GpuObservation(reading, listed, agents)


def fired(rule: rules.Rule, facts: GpuObservation) -> list[rules.Suggestion]:
    return list(rule(facts))


# ------------------------------------------------------------------------------ usage


@pytest.mark.parametrize(
    ("share", "severity"),
    [(0.86, "warning"), (0.91, "critical"), (0.96, "emergency")],
)
def test_usage_thresholds(share: float, severity: str):
    found = fired(rules.usage, gpu(device(), used=int(share * TOTAL)))
    assert [s.severity for s in found] == [severity]
    assert found[0].effect_bytes == int(share * TOTAL) - int(0.85 * TOTAL)
    assert found[0].pid == 100


def test_usage_below_85_percent_says_nothing():
    assert fired(rules.usage, gpu(device(), used=int(0.84 * TOTAL))) == []


def test_usage_points_at_a_neighbours_cache_when_there_is_one():
    hog = device(pid=200, allocated=10 * GiB, reserved=30 * GiB)
    found = fired(rules.usage, gpu(device(), hog, used=int(0.93 * TOTAL)))
    assert found[0].fix == "memtop cleanup 200"


# ------------------------------------------------------------------------------ OOM


def test_recent_ooms_are_critical_and_old_ones_are_not_repeated():
    found = fired(rules.out_of_memory, gpu(device(pressure=Pressure(5, 2, 1, 1, 600.0))))
    assert [s.severity for s in found] == ["critical"] and "1 out-of-memory" in found[0].title
    assert fired(rules.out_of_memory, gpu(device(pressure=Pressure(5, 2, 0, 0, 600.0)))) == []


# ------------------------------------------------------------------------------ expandable


def test_fragmentation_suggests_expandable_segments_keeping_other_options():
    facts = gpu(device(fragmentation=frag(0.3, 2 * GiB), conf="max_split_size_mb:128"))
    (found,) = fired(rules.expandable_segments, facts)
    assert found.fix == "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True"
    assert found.effect_bytes == 2 * GiB
    assert found.severity == "warning"


def test_retries_under_pressure_make_it_critical():
    facts = gpu(device(pressure=Pressure(9, 0, 9, 0, 600.0)), used=int(0.95 * TOTAL))
    (found,) = fired(rules.expandable_segments, facts)
    assert found.severity == "critical" and "retries" in found.evidence


@pytest.mark.parametrize(
    "conf",
    ["expandable_segments:True", "garbage_collection_threshold:0.6, expandable_segments : True"],
)
def test_expandable_segments_is_not_suggested_when_the_trainer_has_it(conf: str):
    facts = gpu(device(fragmentation=frag(0.4, 4 * GiB), conf=conf))
    assert fired(rules.expandable_segments, facts) == []


def test_a_spelling_torch_refuses_is_not_expandable_segments():
    # torch takes True or False only (memtop.base.alloc_conf): `:1` is not on, and the fix spells
    # it.
    conf = "garbage_collection_threshold:0.6,expandable_segments:1"
    (found,) = fired(
        rules.expandable_segments, gpu(device(fragmentation=frag(0.4, 4 * GiB), conf=conf))
    )
    assert found.fix == (
        "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,expandable_segments:True"
    )


def test_expandable_segments_is_not_suggested_without_fragmentation_or_retries():
    assert fired(rules.expandable_segments, gpu(device(fragmentation=frag(0.1, 4 * GiB)))) == []
    assert fired(rules.expandable_segments, gpu(device(fragmentation=frag(0.5, 16 * MiB)))) == []
    async_backend = device(fragmentation=frag(0.5, 4 * GiB), conf="backend:cudaMallocAsync")
    assert fired(rules.expandable_segments, gpu(async_backend)) == []


def test_fragmentation_is_not_judged_on_one_or_two_readings():
    # `--once` after its first round (a loaded box) had one reading: the peak right after a
    # step freed its activations, 0.34 in the oom demo, whose median over a step is ~0.08.
    high = Fragmentation(0.34, 0.34, 2 * GiB, 10 * GiB, None, None, None, 0, samples=2)
    assert fired(rules.expandable_segments, gpu(device(fragmentation=high))) == []
    judged = dataclasses.replace(high, samples=3)
    (found,) = fired(rules.expandable_segments, gpu(device(fragmentation=judged)))
    assert found.title == "Fragmentation 0.34: use expandable segments"
    # Retries are counted, not sampled: they need no median.
    retries = device(fragmentation=high, pressure=Pressure(9, 0, 9, 0, 600.0))
    assert len(fired(rules.expandable_segments, gpu(retries))) == 1


def test_allocator_conf_parsing():
    # Keys as written: torch's are case sensitive (tests/test_alloc_conf.py).
    assert parse_allocator_conf(" expandable_segments : True , max_split_size_mb:64") == {
        "expandable_segments": "True",
        "max_split_size_mb": "64",
    }


# ------------------------------------------------------------------------------ leak


def leak(seconds_to_full: float | None) -> LeakEstimate:
    return LeakEstimate(
        True, 8 * MiB, 80 * MiB, 1000, seconds_to_full, 0.999, "steps", 500, 10.0, "grows"
    )


@pytest.mark.parametrize(
    ("seconds", "severity"), [(120, "emergency"), (1200, "critical"), (86_400, "warning")]
)
def test_a_leak_is_reported_with_rate_eta_and_culprits(seconds: float, severity: str):
    (found,) = fired(rules.leak, gpu(device(leak=leak(seconds))))
    assert found.severity == severity
    assert "+8.0 MiB per step" in found.title and "full in" in found.title
    assert "retain_graph" in found.detail
    assert found.effect_bytes == 80 * MiB * 3600


def test_a_leak_without_stacks_says_which_reading_would_name_its_line():
    # The culprits are possibilities; which one rests on stack recording, off here (issue 31,
    # item 7): the suggestion says so and how to turn it on, rather than leave it unsaid.
    (found,) = fired(rules.leak, gpu(device(leak=leak(1200))))
    assert "without stack recording" in found.detail and "press w" in found.detail


def test_no_leak_no_leak_suggestion():
    not_a_leak = dataclasses.replace(leak(100), detected=False)
    assert fired(rules.leak, gpu(device(leak=not_a_leak))) == []


def test_rules_that_cannot_fire_ask_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    # Judged for every GPU and trainer every round: a GPU under every usage level's exit limit
    # (held or not) did not need its heaviest process and its preallocators worked out, nor a
    # trainer without split segments or retries its allocator's options parsed for the veto.
    asked: list[str] = []
    heaviest, vetoed = rules._heaviest, rules.expandable_segments_vetoed

    def heaviest_asked(gpu: GpuObservation) -> Any:
        asked.append("heaviest")
        return heaviest(gpu)

    def veto_asked(agent: DeviceDiagnosis) -> Any:
        asked.append("veto")
        return vetoed(agent)

    monkeypatch.setattr(rules, "_heaviest", heaviest_asked)
    monkeypatch.setattr(rules, "expandable_segments_vetoed", veto_asked)
    calm = gpu(device(), used=int(0.81 * TOTAL))  # under 0.85 - 0.03
    everything = [(rule.id, 100, 0) for rule in rules.RULES]
    for held in ((), everything):
        assert fired(rules.usage, calm) == [] and list(rules.usage(calm, held=held)) == []
        assert list(rules.expandable_segments(calm, held=held)) == []
    assert asked == []
    # At the exit limit a held warning stays (asked, and fires); a new one waits for 0.85.
    edge = gpu(device(), used=int(0.83 * TOTAL))
    assert fired(rules.usage, edge) == []
    (kept,) = rules.usage(edge, held={(rules.RuleId.USAGE, 100, 0)})
    assert kept.severity == "warning" and "heaviest" in asked


# ------------------------------------------------------------------------------ breakdown rules

BREAKDOWN = {
    "parameters": 6 * GiB,
    "gradients": 6 * GiB,
    "optimizer_state": 12 * GiB,
    "fp32_parameter_bytes": 6 * GiB,
}


def test_a_large_optimizer_state_suggests_an_8bit_optimizer_with_the_saving():
    (found,) = fired(rules.eight_bit_optimizer, gpu(device(breakdown=BREAKDOWN)))
    assert found.effect_bytes == 9 * GiB  # 3/4 of 12 GiB


def test_a_small_optimizer_state_does_not():
    small = dict(BREAKDOWN, optimizer_state=2 * GiB)  # 2 of 30 GiB peak
    assert fired(rules.eight_bit_optimizer, gpu(device(breakdown=small))) == []
    assert fired(rules.eight_bit_optimizer, gpu(device(breakdown=None))) == []


def test_fp32_parameters_suggest_bf16_with_the_saving():
    (found,) = fired(rules.bf16_parameters, gpu(device(breakdown=BREAKDOWN)))
    assert found.effect_bytes == 3 * GiB + 3 * GiB  # half the weights, half their gradients


def test_bf16_parameters_do_not():
    bf16 = dict(BREAKDOWN, fp32_parameter_bytes=0)
    assert fired(rules.bf16_parameters, gpu(device(breakdown=bf16))) == []


def test_the_breakdown_tips_are_worded_once_while_their_figures_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The 8-bit optimizer and bf16 tips read a trainer's breakdown and its true peak only; in
    # the `mixed` demo they were 20 of 31 suggestions, every word of them the same every
    # round, worded anew (sizes printed, a finding made) for every trainer each second.
    worded: list[float] = []
    printed = rules.format_bytes

    def counted(n: float | None) -> str:
        worded.append(n or 0)
        return printed(n)

    monkeypatch.setattr(rules, "format_bytes", counted)
    for name in ("_eight_bit_finding", "_bf16_finding"):  # judged by the tests before
        if hasattr(rules, name):
            getattr(rules, name).cache_clear()  # as a new memtop
    tips = (rules.eight_bit_optimizer, rules.bf16_parameters)
    first = [s for rule in tips for s in fired(rule, gpu(device(breakdown=BREAKDOWN)))]
    assert len(first) == 2 and worded
    # The next round: the sawtooth moved (allocated, reserved), the breakdown and peak did not.
    worded.clear()
    moved = device(allocated=22 * GiB, reserved=25 * GiB, breakdown=dict(BREAKDOWN))
    again = [s for rule in tips for s in fired(rule, gpu(moved))]
    assert again == first
    assert worded == []  # nothing worded again
    # A new peak words them anew (the share of the peak moved), as a first judgment does.
    higher = [
        s for rule in tips for s in fired(rule, gpu(device(peak=40 * GiB, breakdown=BREAKDOWN)))
    ]
    assert worded and higher != first
    assert "30.0 % of the peak" in higher[0].title  # 12 GiB of optimizer state of 40
    # ... and a byte count given as a float is its own judgment (its effect says 6.0, not 6).
    floats = dict(BREAKDOWN, optimizer_state=8.0)
    small = device(peak=8, breakdown=floats)
    assert fired(rules.eight_bit_optimizer, gpu(small)) == []  # below BIG_ENOUGH either way
    assert rules._eight_bit_finding(8 * GiB, 16 * GiB, False).effect_bytes == 6 * GiB  # type: ignore[union-attr]
    as_float = rules._eight_bit_finding(float(8 * GiB), 16 * GiB, False)
    assert repr(as_float.effect_bytes) == repr(float(6 * GiB))  # type: ignore[union-attr]


def test_activations_dominating_a_tight_peak_suggest_checkpointing():
    breakdown = dict(BREAKDOWN, parameters=4 * GiB, optimizer_state=8 * GiB)
    facts = gpu(device(peak=70 * GiB, breakdown=breakdown), used=int(0.9 * TOTAL))
    (found,) = fired(rules.gradient_checkpointing, facts)
    assert found.effect_bytes == (70 - 12) * GiB * 2 // 3
    assert found.severity == "warning"


def test_checkpointing_is_not_suggested_when_memory_is_not_short_or_activations_are_small():
    breakdown = dict(BREAKDOWN, parameters=4 * GiB, optimizer_state=8 * GiB)
    roomy = gpu(device(peak=70 * GiB, breakdown=breakdown), used=int(0.5 * TOTAL))
    assert fired(rules.gradient_checkpointing, roomy) == []
    static_heavy = gpu(device(peak=30 * GiB, breakdown=BREAKDOWN), used=int(0.9 * TOTAL))
    assert fired(rules.gradient_checkpointing, static_heavy) == []


# ------------------------------------------------------------------------------ cleanup


def test_cache_held_while_a_neighbour_retries_suggests_cleanup():
    hog = device(pid=200, allocated=10 * GiB, reserved=30 * GiB)
    short = device(pid=300, pressure=Pressure(4, 0, 4, 0, 600.0))
    found = fired(rules.cleanup_for_neighbour, gpu(hog, short, used=int(0.7 * TOTAL)))
    assert [s.pid for s in found] == [200]
    assert found[0].fix == "memtop cleanup 200"
    assert found[0].effect_bytes == 20 * GiB


def test_no_cleanup_when_alone_or_nobody_is_short():
    hog = device(pid=200, allocated=10 * GiB, reserved=30 * GiB)
    assert fired(rules.cleanup_for_neighbour, gpu(hog, used=int(0.95 * TOTAL))) == []
    calm = device(pid=300)
    assert fired(rules.cleanup_for_neighbour, gpu(hog, calm, used=int(0.6 * TOTAL))) == []
    # Only the hog itself retries: its own cache is already open to it (and the calm
    # neighbour caches too little to matter).
    retrying_hog = dataclasses.replace(hog, pressure=Pressure(3, 0, 3, 0, 600.0))
    lean = device(pid=300, allocated=20 * GiB, reserved=20 * GiB + 100 * MiB)
    assert fired(rules.cleanup_for_neighbour, gpu(retrying_hog, lean, used=int(0.6 * TOTAL))) == []
    # ... while a neighbour that does cache a lot is asked to give it back.
    (found,) = fired(rules.cleanup_for_neighbour, gpu(retrying_hog, calm, used=int(0.6 * TOTAL)))
    assert found.pid == 300 and found.effect_bytes == 4 * GiB


# ------------------------------------------------------------------------------ bigger batch


def test_headroom_says_how_much_larger_a_batch_fits():
    alone = device(allocated=10 * GiB, reserved=16 * GiB, peak=14 * GiB, baseline=10 * GiB)
    (found,) = fired(rules.bigger_batch, gpu(alone, used=17 * GiB))
    # 4 GiB per step on top of the baseline.  At the peak the cache holds 16 − 14 = 2 GiB: 63 GiB
    # free + 2 GiB − 4 GiB spare = 61 GiB.  The 6 GiB cached at this moment are not all spare:
    # 4 of them are the step's own transient, which comes back at every peak.
    assert found.effect_bytes == 63 * GiB + 2 * GiB - int(0.05 * TOTAL)
    # memtop estimate --from's model: the cache keeps 2 GiB per 4 GiB of transient, and keeps
    # it at any batch: (16 + 63 − 4 − 10) / (4 × 1.5) = 10.8 times the batch (16.2 counted the
    # 2 GiB as spare, and the larger batch's own cache overhead as room).
    assert "10.8×" in found.title


def test_headroom_does_not_move_with_the_moment_in_the_step():
    # The same trainer sampled at its baseline and at its peak: the same room either way.
    at_baseline = device(allocated=10 * GiB, reserved=16 * GiB, peak=14 * GiB, baseline=10 * GiB)
    at_peak = device(allocated=14 * GiB, reserved=16 * GiB, peak=14 * GiB, baseline=10 * GiB)
    rooms = {
        found.effect_bytes
        for facts in (at_baseline, at_peak)
        for found in fired(rules.bigger_batch, gpu(facts, used=17 * GiB))
    }
    assert len(rooms) == 1


def test_no_batch_advice_when_full_shared_leaking_or_without_steps():
    alone = device(allocated=10 * GiB, reserved=12 * GiB, peak=14 * GiB, baseline=10 * GiB)
    assert fired(rules.bigger_batch, gpu(alone, used=int(0.75 * TOTAL))) == []
    other = ((alone.pid, 12 * GiB), (999, 1 * GiB))
    assert fired(rules.bigger_batch, gpu(alone, used=13 * GiB, processes=other)) == []
    leaking = dataclasses.replace(alone, leak=leak(3600))
    assert fired(rules.bigger_batch, gpu(leaking, used=13 * GiB)) == []
    no_steps = dataclasses.replace(alone, baseline_bytes=None)
    assert fired(rules.bigger_batch, gpu(no_steps, used=13 * GiB)) == []


def test_suggestions_come_most_severe_first():
    facts = gpu(
        device(breakdown=BREAKDOWN, leak=leak(1200), fragmentation=frag(0.3, 2 * GiB)),
        used=int(0.96 * TOTAL),
    )
    order = [s.severity for s in rules.suggest([facts])]
    assert order[0] == "emergency"
    ranks = [rules.SEVERITIES.index(s) for s in order]
    assert ranks == sorted(ranks, reverse=True)
    assert {"severity", "pid", "device", "title", "detail"} <= set(
        rules.suggest([facts])[0].as_dict()
    )
