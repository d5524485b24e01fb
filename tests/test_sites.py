"""Who holds the memory (issue 23): the user's line behind an OOM, the simulator's block frames,
the sites of live blocks and the leak's line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_suggestions import device, gpu, told

import memtop
from memtop import protocol
from memtop.agent import sites as site_tracking
from memtop.agent import stacks
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.agent.sites import site_of
from memtop.cli import main
from memtop.diagnosis import suggestions as rules
from memtop.diagnosis.fragmentation import Pressure
from memtop.sim import scenarios
from memtop.sim.allocator import SimulatedCachingAllocator, SimulatedOutOfMemoryError
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sim.scenarios import Workload, model_for
from memtop.sources.agents import AgentClient, AgentError

MiB = 1 << 20
GiB = 1 << 30
HERE = Path(__file__).resolve()
MEMTOP_PACKAGE = Path(memtop.__file__).resolve().parent


def in_memtop_package(file: str) -> bool:
    return Path(file).resolve().is_relative_to(MEMTOP_PACKAGE)


def line_of(marker: str) -> int:
    """The line of this file that holds `marker` in a comment (so edits above move nothing)."""
    lines = HERE.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))


@pytest.fixture
def oom_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "oom"
    monkeypatch.setenv("MEMTOP_OOM_DIR", str(directory))
    return directory


@pytest.fixture
def allocator() -> SimulatedCachingAllocator:
    return SimulatedCachingAllocator(LocalDeviceMemory(2 * GiB), 0)


@pytest.fixture
def agent(socket_dir: Path, allocator: SimulatedCachingAllocator, oom_dir: Path) -> Iterator[Agent]:
    info = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000001", "Sim GPU", 2 * GiB)
    probe = SimulatedProbe([SimulatedGpu(info, allocator)], current_pass=lambda: "forward")
    server = Agent(probe, socket_dir, argv=["train.py"])
    server.start()
    server.boundary.mark_interval_s = 0.0
    yield server
    server.stop()


def attention(allocator: SimulatedCachingAllocator, size: int) -> int:
    scores = allocator.malloc(size)  # the failing request
    return scores


def forward(allocator: SimulatedCachingAllocator, size: int) -> int:
    return attention(allocator, size)  # the caller


def test_an_oom_report_names_the_line_of_the_failing_request(agent, allocator, oom_dir, capsys):
    weights = allocator.malloc(1 * GiB)
    with pytest.raises(SimulatedOutOfMemoryError):
        forward(allocator, 3 * GiB // 2)
    assert agent.oom.flush(5.0)
    (path,) = oom_dir.glob("oom-*.json")
    report = json.loads(path.read_text())
    # Stack recording is off: the observer's own walk of the allocating thread found it.
    innermost, caller = report["stack"][:2]
    assert innermost == {
        "file": str(HERE),
        "line": line_of("the failing request"),
        "function": "attention",
        "text": "scores = allocator.malloc(size)  # the failing request",
    }
    assert caller["function"] == "forward" and caller["line"] == line_of("the caller")
    # No frame of the memtop package (keyed on the package's own folder, not on a folder named
    # memtop: a clone in ~/src/memtop holds this very test file under …/memtop/tests/).
    assert not any(in_memtop_package(frame["file"]) for frame in report["stack"])
    assert 0 < report["stack_capture_us"] < 1e6
    # The headline the dashboard reads carries the line too.
    assert agent.oom.status()["last"]["stack"] == [innermost]
    # `memtop oom REPORT` says it.
    assert main(["oom", str(path)]) == 0
    out = capsys.readouterr().out
    shown = f"in `test_sites.py:{line_of('the failing request')} scores = allocator.malloc(size)"
    assert shown in out and "in attention()" in out
    assert f"test_sites.py:{line_of('the caller')} return attention(allocator, size)" in out
    assert main(["oom", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reports"][0]["stack"][0] == innermost
    allocator.free(weights)


def test_the_dashboards_oom_line_names_the_failing_line():
    report = {
        "step": 12,
        "phase": "forward",
        "diagnosis": {"cause": "too_big", "detail": "d", "fix": "f"},
        "stack": [
            {"file": "/home/u/model.py", "line": 88, "function": "forward",
             "text": "attn = q @ k.transpose(-2, -1)"}
        ],
    }  # fmt: skip
    ran_out = told(
        dataclasses.replace(device(), pressure=Pressure(1, 1, 1, 1, 60.0)), last_oom=report
    )
    (shown,) = rules.out_of_memory(gpu(ran_out))
    assert shown.title.endswith("in `model.py:88 attn = q @ k.transpose(-2, -1)`"), shown.title
    # An older agent's headline has no stack: the title is as before.
    older = told(ran_out, last_oom={k: v for k, v in report.items() if k != "stack"})
    (shown,) = rules.out_of_memory(gpu(older))
    assert "`" not in shown.title


def test_the_stack_walk_is_bounded_and_cheap():
    def deep(n: int) -> list[dict]:
        return deep(n - 1) if n else stacks.capture()

    frames = deep(500)  # deeper than the walk goes: the innermost user frames all the same
    assert len(frames) == stacks.USER_FRAMES and all(f["function"] == "deep" for f in frames)
    started = time.perf_counter()
    for _ in range(200):
        deep(20)
    per_call_us = (time.perf_counter() - started) / 200 * 1e6
    assert per_call_us < 5000  # measured: tens of µs; this box is shared and noisy


# ------------------------------------------------------------------ the simulator's history


def scenario_line(marker: str) -> tuple[str, int]:
    """(file, line) of memtop.sim.scenarios that holds `marker`."""
    path = Path(scenarios.__file__)
    lines = path.read_text().splitlines()
    return str(path), next(i for i, text in enumerate(lines, 1) if marker in text)


def test_the_simulated_allocator_keeps_each_blocks_frames_in_torchs_format(allocator):
    untracked = allocator.malloc(4 * MiB)
    allocator.record_history(True)
    tracked = attention(allocator, 4 * MiB)
    blocks = {b["address"]: b for s in allocator.snapshot()["segments"] for b in s["blocks"]}
    assert blocks[untracked]["frames"] == []  # allocated before history was on
    innermost = blocks[tracked]["frames"][0]
    assert innermost == {
        "filename": str(HERE),
        "line": line_of("the failing request"),
        "name": "attention",
    }
    allocator.free(tracked)
    again = allocator.malloc(4 * MiB)  # the same address, reused: its own frames
    frames = next(
        b["frames"]
        for s in allocator.snapshot()["segments"]
        for b in s["blocks"]
        if b["address"] == again
    )
    assert (
        frames
        and frames[0]["name"]
        == "test_the_simulated_allocator_keeps_each_blocks_frames_in_torchs_format"
    )
    allocator.record_history(False)
    assert all(b["frames"] == [] for s in allocator.snapshot()["segments"] for b in s["blocks"])


def test_the_leak_scenarios_leak_comes_from_one_known_line(allocator):
    allocator.record_history(True)
    shape = model_for("leak", 2 * GiB, 0.05)
    workload = Workload("leak", allocator, shape, leak_bytes_per_step=4 * MiB)
    for _ in range(5):
        assert workload.step()
    by_site: dict = {}
    for segment in allocator.snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                site = site_of(block["frames"])
                by_site[site] = by_site.get(site, 0) + 1
    filename, line = scenario_line("kept = self._m(self.leak_bytes_per_step)")
    assert by_site[(filename, line, "_leaked_tensors")] == 5
    # `_m` stands for torch's op: no block's site is its own line.
    assert not any(site and site[2] == "_m" for site in by_site)


# ------------------------------------------------------------------ the agent's `sites`


def make_batch(allocator, size):
    return allocator.malloc(size)  # batch site


def make_activations(allocator, size):
    return allocator.malloc(size)  # activations site


def make_logits(allocator, size):
    return allocator.malloc(size)  # logits site


def three_line_step(allocator, kept: list[int], leaking: int) -> None:
    """One step: three similar lines allocate 2 MiB each; the `leaking`-th keeps its block."""
    blocks = [
        make_batch(allocator, 2 * MiB),
        make_activations(allocator, 2 * MiB),
        make_logits(allocator, 2 * MiB),
    ]
    for i, block in enumerate(blocks):
        if i == leaking:
            kept.append(block)  # a list that outlives the step: the leak
        else:
            allocator.free(block)


@pytest.fixture
def fast_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(site_tracking, "MIN_INTERVAL_S", 0.0)
    monkeypatch.setattr(site_tracking, "COST_FACTOR", 0)


def client_for(agent: Agent) -> AgentClient:
    client = AgentClient(agent.pid, agent.directory, timeout=5.0)
    client.connect()
    return client


def test_sites_are_off_until_asked_and_switched_on_the_trainers_thread(
    agent, allocator, fast_rounds
):
    client = client_for(agent)
    try:
        off = protocol.parse_sites(client.request("sites"))
        assert not off.enabled and off.sites == ()
        asked = client.request("sites", {"stacks": True})
        assert asked["wanted"] and not asked["enabled"]
        assert not allocator.history_enabled  # the agent thread never switches it
        agent.on_step(explicit=True)  # the trainer's step boundary: switched here
        assert allocator.history_enabled
        with pytest.raises(AgentError, match="boolean"):
            client.request("sites", {"stacks": "yes"})
        client.request("sites", {"stacks": False})
        agent.on_step(explicit=True)
        assert not allocator.history_enabled and not client.request("sites")["enabled"]
    finally:
        client.close()


def test_sites_are_not_switched_during_a_cuda_graph_capture(agent, allocator, fast_rounds):
    capturing = {"now": True}
    agent.probe.is_capturing = lambda: capturing["now"]  # type: ignore[method-assign]
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    assert not allocator.history_enabled
    capturing["now"] = False
    agent.on_step(explicit=True)
    assert allocator.history_enabled


@pytest.mark.parametrize("leaking", [0, 1, 2])
def test_the_site_that_keeps_its_blocks_is_the_leaks_line(agent, allocator, fast_rounds, leaking):
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    kept: list[int] = []
    for _ in range(6):
        three_line_step(allocator, kept, leaking)
        agent.on_step(explicit=True)
    client = client_for(agent)
    try:
        reply = protocol.parse_sites(client.request("sites"))
    finally:
        client.close()
    assert reply.enabled and reply.step == 7
    (top,) = [s for s in reply.sites if s.blocks > 0][:1]
    marker = ["batch site", "activations site", "logits site"][leaking]
    assert top.site.file == str(HERE) and top.site.line == line_of(marker)
    assert top.site.text.endswith(f"# {marker}")
    assert top.bytes == 6 * 2 * MiB and top.blocks == 6
    assert top.old_blocks == 5  # alive at the previous reading: all but this step's
    assert len(reply.sites) == 1  # the other lines hold nothing at the boundary


def test_a_grouping_round_over_its_time_cap_is_skipped(agent, allocator, monkeypatch):
    monkeypatch.setattr(site_tracking, "MIN_INTERVAL_S", 0.0)
    monkeypatch.setattr(site_tracking, "COST_FACTOR", 0)
    monkeypatch.setattr(site_tracking, "ROUND_CAP_S", 0.0)
    monkeypatch.setattr(site_tracking, "CHECK_EVERY", 1)
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    kept = [make_batch(allocator, MiB) for _ in range(4)]
    agent.on_step(explicit=True)
    assert agent.sites.rounds == 0 and agent.sites.rounds_abandoned == 1
    assert agent.sites.result()["sites"] == []
    for block in kept:
        allocator.free(block)


def test_an_oom_report_carries_the_live_sites_when_stacks_are_on(
    agent, allocator, oom_dir, fast_rounds
):
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    held = make_activations(allocator, GiB)
    agent.on_step(explicit=True)
    with pytest.raises(SimulatedOutOfMemoryError):
        forward(allocator, 3 * GiB // 2)
    assert agent.oom.flush(5.0)
    (path,) = oom_dir.glob("oom-*.json")
    report = json.loads(path.read_text())
    assert report["sites"][0]["site"]["line"] == line_of("activations site")
    assert report["sites"][0]["bytes"] == GiB
    allocator.free(held)


def test_stacks_from_the_environment(monkeypatch):
    assert site_tracking.stacks_wanted({"MEMTOP_STACKS": "1"})
    assert not site_tracking.stacks_wanted({"MEMTOP_STACKS": "0"})
    assert not site_tracking.stacks_wanted({})


def test_memtop_run_stacks_turns_them_on(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(
        "import json, memtop.agent\n"
        "agent = memtop.agent.current_agent()\n"
        "print(json.dumps({'wanted': agent.sites.wanted if agent else None}))\n"
    )
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(tmp_path / "s"))
    env.pop("MEMTOP_STACKS", None)
    for flags, wanted in ((["--stacks", "--auto-cleanup"], True), ([], False)):
        done = subprocess.run(
            [sys.executable, "-m", "memtop.cli", "run", *flags, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1]) == {"wanted": wanted}


# ------------------------------------------------------------------ the viewer names the line


@pytest.mark.slow
def test_the_leak_demo_with_stacks_names_the_leaking_line(socket_dir: Path):
    from test_diagnosis_scenarios import Watch

    from memtop.present import report
    from memtop.sim.demo import Demo

    demo = Demo(
        gpus=1,
        scenario="leak",
        step_time=0.02,
        socket_dir=socket_dir,
        extra_env={"MEMTOP_STACKS": "1"},
    )
    demo.start()
    watch = Watch(socket_dir)
    watch.sampler.agents.low_rate["sites"] = 0.5
    try:
        assert demo.wait_ready(30)
        started = time.monotonic()
        diagnosis = watch.until(
            60, lambda d: any(s.rule == "leak" and "`" in s.title for s in d.suggestions)
        )
        took = time.monotonic() - started
    finally:
        watch.sampler.stop()
        demo.stop()
    filename, line = scenario_line("kept = self._m(self.leak_bytes_per_step)")
    (shown,) = [s for s in diagnosis.suggestions if s.rule == "leak"]
    (device,) = diagnosis.devices.values()
    readings = watch.store.agent(demo.processes[0].pid).sites
    # What the viewer had, should it not name the line (this box is shared: rounds run late).
    assert "`" in shown.title, (took, len(readings), [r.step for r in readings], device.sites[:3])
    assert shown.title.startswith(
        f"Leak: blocks from `scenarios.py:{line} kept = self._m(self.leak_bytes_per_step)` "
        "outlive their step: +8.0 MiB per step"
    ), shown.title
    assert took < 60
    top = device.sites[0]
    assert top.leaking and (top.site.file, top.site.line) == (filename, line)
    assert 7 * MiB < (top.bytes_per_step or 0) < 9 * MiB
    # --once --json carries the sites per agent.
    data = report.build(watch.observer.latest())
    (agent,) = data["agents"]
    assert agent["sites"][0]["site"]["line"] == line and agent["sites"][0]["leaking"]
    # The exporter: a bounded family with a `site` label.
    from memtop.export.metrics import EXPORT_TOP_SITES, render

    (family,) = [f for f in render(watch.observer.latest()) if f.name == "memtop_site_bytes"]
    labels = [sample.labels["site"] for sample in family.samples]
    assert f"scenarios.py:{line}" in labels and len(labels) <= EXPORT_TOP_SITES


def test_a_leak_in_one_of_three_similar_lines_is_named_ten_runs_of_ten(
    agent, allocator, fast_rounds
):
    import random

    from memtop.diagnosis.leak import LeakEstimate
    from memtop.diagnosis.sites import leaking_site, site_trends

    markers = ["batch site", "activations site", "logits site"]
    detected = LeakEstimate(True, 2 * MiB, None, None, None, 0.99, "steps", 60, 1, "grows")
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    for run in range(10):
        rng = random.Random(run)
        leaking = rng.randrange(3)
        kept: list[int] = []
        carried: list[int] = []  # the other lines' blocks, now and then alive across a step
        readings = []
        for _ in range(8):
            for block in carried:
                allocator.free(block)
            carried = []
            blocks = [make(allocator, rng.randint(1, 4) * MiB) for make in
                      (make_batch, make_activations, make_logits)]  # fmt: skip
            for i, block in enumerate(blocks):
                if i == leaking:
                    kept.append(block)
                elif rng.random() < 0.5:
                    carried.append(block)
                else:
                    allocator.free(block)
            agent.on_step(explicit=True)
            readings.append(protocol.parse_sites(agent.sites.result()))
        culprit = leaking_site(site_trends(readings, 0, detected))
        assert culprit is not None, run
        assert culprit.site.line == line_of(markers[leaking]), (run, culprit)
        # Without a detected leak no line is blamed.
        assert leaking_site(site_trends(readings, 0, None)) is None
        for block in kept + carried:
            allocator.free(block)


def test_the_who_holds_it_table_marks_the_leak_and_hides_without_sites():
    import asyncio

    from rich.console import Console
    from textual.app import App, ComposeResult

    from memtop.diagnosis.sites import SiteTrend
    from memtop.model import Site
    from memtop.ui.widgets.sites_table import SitesPanel, sites_table

    leak = SiteTrend(
        Site("/home/u/train.py", 45, "train", "out = model(x)"),
        96 * MiB, 8, 7, 12 * MiB, 310, leaking=True,
    )  # fmt: skip
    weights = SiteTrend(Site("", 0, "", ""), 2 * GiB, 40, 40, 0.0, 300)
    console = Console(width=120, record=True)
    console.print(sites_table([leak, weights]))
    text = console.export_text()
    first, second = [line for line in text.splitlines() if line.strip()][1:3]
    assert "◀ leak train.py:45" in first and "out = model(x)" in first
    assert "+12.0 MiB/step" in first and "8 (7 old)" in first
    assert "(before stacks)" in second

    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield SitesPanel()

    async def run() -> None:
        app = Host()
        async with app.run_test() as pilot:
            panel = app.query_one(SitesPanel)
            assert not panel.display  # no stacks: no table
            panel.show([leak])
            await pilot.pause()
            assert panel.display and panel.region.height > 2
            panel.show([])
            await pilot.pause()
            assert not panel.display

    asyncio.run(run())


def test_a_recordings_sites_replies_are_replayed():
    from memtop.sources.recording import LineTally
    from memtop.sources.replay import _agent_event

    site = {"file": "/u/train.py", "line": 45, "function": "train", "text": "out = model(x)"}
    result = {
        "enabled": True,
        "time": 100.0,
        "step": 310,
        "sites": [{"device": 0, "site": site, "bytes": MiB, "blocks": 2, "old_blocks": 1}],
    }
    skipped = LineTally()
    event = _agent_event(100.0, 7, "sites", result, (Path("rec.jsonl"), 3), skipped)
    assert event is not None and event.kind == "sites" and not skipped.count
    assert event.value.sites[0].site.line == 45
    broken = {**result, "sites": [{"device": 0}]}
    assert _agent_event(100.0, 7, "sites", broken, (Path("rec.jsonl"), 4), skipped) is None
    assert skipped.count == 1 and "rec.jsonl:4: sites" in skipped.examples[0]


@pytest.mark.slow
def test_the_stacks_key_asks_then_the_detail_screen_shows_who_holds_it(socket_dir: Path):
    import asyncio

    from test_ui_live import agent_rows, live_app, select
    from ui_helpers import notifications, screen_text, wait_for

    from memtop.sim.demo import Demo
    from memtop.ui.screens.confirm import ConfirmScreen
    from memtop.ui.screens.detail import DetailScreen

    demo = Demo(gpus=1, scenario="leak", step_time=0.05, socket_dir=socket_dir)
    demo.start()
    app, sampler = live_app(socket_dir)
    _, line = scenario_line("kept = self._m(self.leak_bytes_per_step)")

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: len(agent_rows(app)) == 1, 30)
            pid = agent_rows(app)[0].pid
            await select(app, pid)
            await pilot.press("w")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            assert "a few % of step time" in screen_text(app.export_screenshot())
            await pilot.press("y")
            await wait_for(
                pilot, lambda: any("Stack recording asked" in n for n in notifications(app))
            )
            await wait_for(pilot, lambda: bool(app.store.agent(pid).sites), 30)
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
            await wait_for(
                pilot,
                lambda: f"scenarios.py:{line}" in screen_text(app.export_screenshot()),
                60,
            )
            text = screen_text(app.export_screenshot())
            assert "Who holds it" in text and "kept = self._m(self.leak_bytes_per_step)" in text

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
        demo.stop()


# ------------------------------------------------------------------ real torch


def test_the_torch_probe_records_nothing_before_a_device_is_in_use():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is already initialised in this process")
    from memtop.agent.torch_probe import TorchProbe

    probe = TorchProbe()
    assert probe.record_history(True) is False  # nothing to record: asked again later
    assert not torch.cuda.is_initialized()  # and no CUDA context made for it


GPU_OOM_LINE = """\
import json, torch, memtop
agent = memtop.start_agent()
torch.cuda.set_per_process_memory_fraction(0.05, 0)
big = int(0.2 * torch.cuda.get_device_properties(0).total_memory)
try:
    x = torch.empty(big, dtype=torch.uint8, device="cuda")  # the failing request
except torch.OutOfMemoryError:
    pass
agent.oom.flush(10)
memtop.agent.stop_agent()
"""

GPU_LEAK_LINE = """\
import json, time, torch, memtop
agent = memtop.start_agent()
model = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
kept = []
for step in range(120):
    x = torch.randn(64, 256, device="cuda")
    a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # similar line 1
    b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # similar line 2
    c = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # similar line 3
    kept.append(b)
    model(x).sum().backward(); opt.step(); opt.zero_grad(set_to_none=True)
    time.sleep(0.05)
print(json.dumps(agent.sites.result()))
memtop.agent.stop_agent()
"""


def _run_gpu_script(tmp_path: Path, text: str, **env_extra: str) -> subprocess.CompletedProcess:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    script = tmp_path / "train.py"
    script.write_text(text)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(tmp_path / "s"), **env_extra)
    env["MEMTOP_OOM_DIR"] = str(tmp_path / "oom")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.gpu
def test_a_real_cuda_oom_names_its_line(tmp_path: Path):
    _run_gpu_script(tmp_path, GPU_OOM_LINE)
    (path,) = (tmp_path / "oom").glob("oom-*.json")
    report = json.loads(path.read_text())
    assert report["stack"][0]["file"] == str(tmp_path / "train.py")
    assert report["stack"][0]["line"] == 6, report["stack"]
    assert "torch.empty(big" in report["stack"][0]["text"]


@pytest.mark.gpu
def test_a_real_cuda_leak_is_named_by_its_line(tmp_path: Path):
    done = _run_gpu_script(tmp_path, GPU_LEAK_LINE, MEMTOP_STACKS="1")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["enabled"], result
    mine = [s for s in result["sites"] if s["site"]["file"] == str(tmp_path / "train.py")]
    top = max(mine, key=lambda s: s["bytes"])
    assert top["site"]["line"] == 9, mine  # similar line 2: the one kept
    assert top["blocks"] >= 10 and top["old_blocks"] >= 5


def test_a_switch_that_cannot_be_made_is_retried_every_few_seconds_not_every_step(agent, allocator):
    calls = []
    agent.probe.record_history = lambda on: calls.append(on) or False  # type: ignore[attr-defined]
    agent.sites.wanted = True
    for _ in range(50):
        agent.on_step(explicit=True)
    assert calls == [True] and not agent.sites.enabled


def test_an_agent_about_to_record_stacks_is_asked_again_at_the_usual_pace(agent: Agent):
    """MEMTOP_STACKS=1 (or `k`) switches recording on at the trainer's next boundary.  A `sites`
    reply before it (enabled false, wanted true) is read again at the pool's usual pace; only
    an agent that records none and was not asked to waits SITES_OFF_RETRY_S (a trainer started
    with stacks showed no site for its first 30 s)."""
    from memtop.sources.agents import AgentPool

    pool = AgentPool(agent.directory, timeout=2.0)
    pool.low_rate = {"sites": 0.2}
    try:
        agent.sites.wanted = True  # no boundary yet: not enabled
        asked_at = time.monotonic()
        polls = [pool.poll() for _ in range(3)]
        (sites,) = [p.sites_reply for p in polls[0] if p.sites_reply is not None]
        assert not sites.enabled and sites.wanted
        due = pool._due[(agent.pid, "sites")] - asked_at
        assert due < 1.0, due
        agent.sites.wanted = False
        pool.ask_soon(agent.pid, "sites")
        asked_at = time.monotonic()
        (off,) = [p.sites_reply for p in pool.poll() if p.sites_reply is not None]
        assert not off.enabled and not off.wanted
        assert pool._due[(agent.pid, "sites")] - asked_at >= pool.SITES_OFF_RETRY_S - 1
    finally:
        pool.close()
