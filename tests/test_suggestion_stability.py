"""Suggestions neither flicker nor reflow (issue 12): hysteresis in every threshold rule and a
minimum time on screen, on synthetic facts and over 3 simulated minutes of the fragment
scenario (a real trainer, the real agent and sampler; the viewer's clock runs 10× fast)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest
from test_suggestions import GiB, device, frag, gpu, told

from memtop.diagnosis import Diagnoser
from memtop.diagnosis import suggestions as rules
from memtop.diagnosis.fragmentation import Pressure
from memtop.diagnosis.stability import GRACE_S, MIN_DWELL_S, Stabilizer
from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource


def fragmented(gauge: float):
    return gpu(device(fragmentation=frag(gauge, 2 * GiB)))


def flips(history: list[set[tuple]]) -> dict[tuple, int]:
    """How many times each suggestion appeared or disappeared after its first appearance."""
    counts: dict[tuple, int] = defaultdict(int)
    for before, after in pairwise(history):
        for key in before ^ after:
            counts[key] += 1
    return counts


def test_gauge_hovering_at_the_line_flaps_raw_but_not_stabilized():
    gauges = [0.21, 0.19, 0.205, 0.18, 0.22, 0.19] * 10  # one reading a second for a minute
    raw = [{s.key for s in rules.suggest([fragmented(g)])} for g in gauges]
    stable = Stabilizer()
    shown = [{s.key for s in stable.suggest([fragmented(g)], t)} for t, g in enumerate(gauges)]
    assert max(flips(raw).values()) > 10  # the raw rules do flap
    assert all(keys == shown[0] for keys in shown) and shown[0]


def test_hysteresis_keeps_a_held_suggestion_until_clearly_below():
    key = ("expandable_segments", 100, 0)
    assert not list(rules.expandable_segments(fragmented(0.18)))
    assert list(rules.expandable_segments(fragmented(0.18), held={key}))
    assert not list(rules.expandable_segments(fragmented(0.15), held={key}))
    usage = gpu(device(reserved=67 * GiB), used=67 * GiB)  # 83.75 %: under 85 %
    assert not list(rules.usage(usage))
    assert list(rules.usage(usage, held={("usage", 100, 0)}))


def test_a_suggestion_goes_after_its_dwell_and_a_gone_process_at_once():
    stable = Stabilizer(rules=[rules.expandable_segments])
    assert stable.suggest([fragmented(0.3)], 0.0)
    assert stable.suggest([fragmented(0.05)], 10.0)  # dwell: still shown
    assert not stable.suggest([fragmented(0.05)], MIN_DWELL_S + 1)
    assert stable.suggest([fragmented(0.3)], 100.0)
    assert not stable.suggest([gpu(used=GiB)], 101.0)  # its process is gone


def test_a_process_whose_agent_misses_a_round_keeps_its_suggestions():
    # An agent that misses its deadline for a round (a step holding the GIL, a loaded box) is
    # hung or unreachable, not gone: its suggestions stayed off for that round and came back
    # the next, a flicker (seen once in the three-minute test below, 1 run in 6 at load ~2).
    # They are kept as a rule that stopped firing is, with the figures of their last firing.
    stable = Stabilizer(rules=[rules.expandable_segments])
    assert stable.suggest([fragmented(0.3)], 0.0)
    silent_round = stable.suggest([gpu(used=GiB)], 1.0, silent={100})
    assert [s.pid for s in silent_round] == [100]
    assert "no longer so" in silent_round[0].evidence
    assert stable.suggest([fragmented(0.3)], 2.0)
    # Silent past its grace and dwell: gone as any suggestion whose rule stopped firing.
    assert not stable.suggest([gpu(used=GiB)], MIN_DWELL_S + GRACE_S + 3, silent={100})
    # A process that is gone goes at once, silent or not, as before.
    assert stable.suggest([fragmented(0.3)], 200.0)
    assert not stable.suggest([gpu(used=GiB)], 201.0)


def test_an_event_that_contradicts_a_suggestion_ends_it_at_once():
    # The oom demo's first seconds: "room for a bigger batch" at 42 % used, then the batch
    # grows into an OOM. The tip stayed up for its minute, beside the OOM, before.
    stable = Stabilizer(rules=[rules.bigger_batch, rules.expandable_segments])
    roomy = device(allocated=10 * GiB, reserved=16 * GiB, peak=14 * GiB, baseline=10 * GiB)
    assert [s.rule for s in stable.suggest([gpu(roomy, used=17 * GiB)], 0.0)] == ["bigger_batch"]
    # The OOM: the tip goes at once. Its retry (before the OOM report is written) suggests
    # expandable segments; the report that says the batch grows ends that, though the gauge
    # (0.18) is within its hold.
    ran_out = dataclasses.replace(
        roomy, pressure=Pressure(1, 1, 1, 1, 600.0), fragmentation=frag(0.18, 2 * GiB)
    )
    shown = stable.suggest([gpu(ran_out, used=17 * GiB)], 1.0)
    assert [s.rule for s in shown] == ["expandable_segments"]
    report = {"diagnosis": {"cause": "growing_batch", "detail": "grew", "fix": "cap it"}}
    explained = told(ran_out, last_oom=report)
    assert stable.suggest([gpu(explained, used=17 * GiB)], 2.0) == ()
    # Fragmentation past the entry line is its own finding, growing batch or not.
    split = dataclasses.replace(explained, fragmentation=frag(0.3, 2 * GiB))
    shown = stable.suggest([gpu(split, used=17 * GiB)], 3.0)
    assert [s.rule for s in shown] == ["expandable_segments"]


def test_severity_falls_only_after_its_dwell():
    stable = Stabilizer(rules=[rules.usage])
    high = gpu(device(reserved=77 * GiB), used=77 * GiB)  # 96 %: emergency
    low = gpu(device(reserved=73 * GiB), used=73 * GiB)  # 91 %: critical
    assert stable.suggest([high], 0)[0].severity == "emergency"
    assert stable.suggest([low], 5)[0].severity == "emergency"
    assert stable.suggest([low], MIN_DWELL_S + 1)[0].severity == "critical"


def test_a_suggestion_quotes_the_round_it_is_shown_with():
    # Issue 21: "Fragmentation 0.23" in a suggestion beside "frag 0.19" on the same screen: the
    # rules' verdict was kept two seconds while every other figure moved on.
    stable = Stabilizer(rules=[rules.expandable_segments, rules.out_of_memory])
    assert stable.suggest([fragmented(0.30)], 0.0)[0].title.startswith("Fragmentation 0.30")
    (now,) = stable.suggest([fragmented(0.27)], 0.5)
    assert now.title.startswith("Fragmentation 0.27") and "0.27" in now.evidence
    # An OOM is judged at once too.
    retried = gpu(device(fragmentation=frag(0.3, 2 * GiB), pressure=Pressure(3, 1, 3, 1, 60.0)))
    assert any(s.rule == "oom" for s in stable.suggest([retried], 0.6))


def test_a_suggestion_kept_after_its_rule_stopped_says_its_figures_are_old():
    # The oom demo: "peak 48.3 GiB" in a tip kept on screen (no flicker) after the peak grew
    # past what the tip is about, beside the table's 76.1 GiB and nothing to tell them apart.
    stable = Stabilizer(rules=[rules.usage])
    high = gpu(device(reserved=77 * GiB), used=77 * GiB)
    (fresh,) = stable.suggest([high], 1_000.0)
    assert "no longer" not in fresh.evidence
    (kept,) = stable.suggest([gpu(device(reserved=20 * GiB), used=20 * GiB)], 1_005.0)
    assert kept.title == fresh.title  # kept as it was, for its dwell
    when = time.strftime("%H:%M:%S", time.localtime(1_000.0))
    assert kept.evidence == f"{fresh.evidence}; as of {when}, no longer so"
    assert (
        stable.suggest(
            [gpu(device(reserved=20 * GiB), used=20 * GiB)], 1_000 + MIN_DWELL_S + GRACE_S
        )
        == ()
    )


@pytest.mark.slow
def test_three_minutes_of_the_fragment_scenario_flip_each_suggestion_at_most_once(
    socket_dir: Path,
):
    demo = Demo(gpus=1, scenario="fragment", step_time=0.02, socket_dir=socket_dir)
    demo.start()
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    clock = [time.time()]
    observer = Observer(store, Diagnoser(leak_refresh_s=0.0), clock=lambda: clock[0])
    try:
        assert demo.wait_ready(30)
        shown: list[set[tuple]] = []
        raw: list[set[tuple]] = []
        for _ in range(180):  # 3 minutes at one round a simulated second
            sampler.sample_once()
            obs = observer.latest()
            shown.append({s.key for s in obs.diagnosis.suggestions})
            raw.append({s.key for s in rules.suggest(obs.diagnosis.gpus)})
            clock[0] += 1.0
            time.sleep(0.1)  # 5 trainer steps between rounds
    finally:
        sampler.stop()
        demo.stop()
    assert any(shown), "the fragment scenario suggested nothing"
    counts = flips(shown)
    print(f"raw flips {dict(flips(raw))}, stabilized {dict(counts)}")
    assert all(n <= 1 for n in counts.values()), counts


def test_played_round_by_round_each_suggestion_quotes_its_rounds_figures():
    # Six real H100 trainers on one GPU, played one second at a time through one Observer as
    # the dashboard is: the cleanup suggestion's "reserved X, allocated Y" is the very figures
    # the same observation gives that process (its table row), every round.
    from memtop.engine.playback import Player
    from memtop.figures.units import format_bytes
    from memtop.sources.replay import load

    traces = Path(__file__).parent / "data" / "traces"
    store = Store()
    player = Player(store, load(traces))
    observer = Observer(store, clock=player.clock)
    checked = 0
    for second in range(40, 170):
        player.seek_offset(second)
        obs = observer.latest()
        for s in obs.suggestions:
            if s.rule != "cleanup" or "no longer so" in s.evidence:
                continue
            dev = obs.device(s.pid, s.device)
            assert dev is not None
            quoted = (
                f"reserved {format_bytes(dev.reserved_bytes)}, "
                f"allocated {format_bytes(dev.allocated_bytes)}"
            )
            assert s.evidence.startswith(quoted), f"at {second} s: {s.evidence!r} ≠ {quoted!r}"
            checked += 1
    assert checked > 100


MARKS = 200
# One busy loop: with the detector's persistence rule taken out this test failed 2 runs of 2 with
# one as with three, and three cost the suite 42 s of CPU.
HOGS = 1
# At the lowest priority: it keeps the box's cores busy and takes nothing the suite's other
# workers ask for.  Without the persistence rule this test failed 4 runs of 5 with it at nice
# 19, as it did with the loop at the workers' priority.
HOG = "import os\nos.nice(19)\nwhile True: pass"


@pytest.mark.slow
def test_the_fragment_scenario_under_a_cpu_hog_raises_no_leak_alarm(socket_dir: Path):
    """Issue 21: under a load average of 6-16 on 2 cores a `leak` suggestion came and went on
    the fragment scenario, whose trainers do not leak.  A loaded box slows each step until
    every step is marked (the agent's 20-a-second limit no longer thins the marks), and the
    fragment baseline, a moving sum of 8 steps' buffers, wanders from mark to mark: read as
    independent points it looked like a rise.  A busy loop loads the box here; the step time
    makes every step marked on a fast box too.  Three trainers: three different baselines."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(HOGS)]
    demo = Demo(gpus=3, scenario="fragment", step_time=0.05, socket_dir=socket_dir)
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    clock = [time.time()]
    observer = Observer(store, Diagnoser(leak_refresh_s=0.0), clock=lambda: clock[0])
    leaks: list[tuple[int, str]] = []
    marks = 0
    try:
        demo.start()
        assert demo.wait_ready(60)
        # The first MARKS step marks of each trainer, judged round by round: where the alarms
        # came (from 46 to 142 marks).  Longer, the fragment baseline's slow wander over
        # hundreds of steps is another matter (a few KiB per step, a week to full).
        for round_ in range(600):
            sampler.sample_once()
            obs = observer.latest()
            leaks += [(round_, s.title) for s in obs.diagnosis.suggestions if s.rule == "leak"]
            marks = min(
                (
                    len(store.step_marks(a.pid, d.index, columns=("step",)).get("step", []))
                    for a in obs.live_agents
                    for d in a.devices
                ),
                default=0,
            )
            if marks >= MARKS and len(obs.live_agents) == 3:
                break
            clock[0] += 1.0
            time.sleep(0.1)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        sampler.stop()
        demo.stop()
    assert marks >= MARKS, f"only {marks} step marks: the scenario did not run long enough"
    assert not leaks, leaks
