"""`memtop tune`: allocator settings changed inside a running trainer (issue 34, item 1).

The agent writes the whole option string in force back with the changed keys, on the trainer's
thread at a step boundary, never under a graph capture; hello and sample carry the settings in
force, and the suggestions read those.  A real CPU torch 2.13 trainer under `memtop run`, the
simulated allocator, and refusals in one line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stepping import Stepper

from memtop import protocol
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.base import alloc_conf
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentClient, AgentError

MiB = 1 << 20
GiB = 1 << 30
DEVICE = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000001", "Sim GPU", 8 * GiB)


def sim_agent(socket_dir: Path, probe: SimulatedProbe) -> Agent:
    server = Agent(probe, socket_dir, argv=["train.py"])
    server.start()
    return server


@pytest.fixture
def allocator() -> SimulatedCachingAllocator:
    return SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0, "max_split_size_mb:64")


@pytest.fixture
def agent(socket_dir: Path, allocator: SimulatedCachingAllocator) -> Iterator[Agent]:
    probe = SimulatedProbe([SimulatedGpu(DEVICE, allocator)], allocator_conf="max_split_size_mb:64")
    server = sim_agent(socket_dir, probe)
    yield server
    server.stop()


def client_for(agent: Agent) -> AgentClient:
    client = AgentClient(agent.pid, agent.directory, timeout=5.0)
    client.connect()
    return client


# --------------------------------------------------------------------------------------------
# The one parser: the whole string written back


def test_a_change_keeps_every_other_key_in_place() -> None:
    conf = "max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4],expandable_segments:False"
    changed = alloc_conf.with_options(conf, {"expandable_segments": "True"})
    assert changed == (
        "max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4],expandable_segments:True"
    )
    assert alloc_conf.with_options("", {"max_split_size_mb": "128"}) == "max_split_size_mb:128"


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("backend", "native", "cannot be changed in a running trainer"),
        ("expandable_segments", "true", "True or False"),
        ("expandable_segments", "1", "True or False"),
        ("garbage_collection_threshold", "1.5", "between 0 and 1"),
        ("garbage_collection_threshold", "x", "between 0 and 1"),
        ("max_split_size_mb", "8", "above 20"),
        ("max_split_size_mb", "-64", "above 20"),
    ],
)
def test_settings_torch_would_refuse_are_refused_in_one_line(key: str, value: str, says: str):
    with pytest.raises(alloc_conf.BadSetting) as info:
        alloc_conf.checked_setting(key, value)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_python_values_take_torchs_spelling() -> None:
    assert alloc_conf.checked_setting("expandable_segments", True) == "True"
    assert alloc_conf.checked_setting("max_split_size_mb", 256) == "256"
    assert alloc_conf.checked_setting("garbage_collection_threshold", "0.6") == "0.6"


# --------------------------------------------------------------------------------------------
# The agent, over its socket, with the simulated probe


def test_tune_runs_at_a_step_boundary_and_keeps_the_users_keys(
    agent: Agent, allocator: SimulatedCachingAllocator
):
    with client_for(agent) as client, Stepper(agent) as stepper:
        assert client.hello is not None
        assert client.hello.allocator_settings == "max_split_size_mb:64"
        result = client.request(
            "tune", {"set": {"expandable_segments": True}, "wait_s": 5}, timeout=10
        )
        assert result["before"] == "max_split_size_mb:64"
        assert result["after"] == "max_split_size_mb:64,expandable_segments:True"
        assert result["changed"] == {"expandable_segments": "True"}
        assert result["at_step_boundary"] is True and result["after_step"] >= 1
        assert result["thread"] == "trainer"
        assert stepper.ident is not None
        sample = client.request("sample")
        assert sample["allocator_settings"] == "max_split_size_mb:64,expandable_segments:True"
        # The allocator follows: the user's split limit kept, expandable segments on.
        assert allocator.config.expandable_segments is True
        assert allocator.config.max_split_size == 64 * MiB
        # The environment's string is still what the trainer started with.
        hello = client.request("hello")
        assert hello["allocator_conf"] == "max_split_size_mb:64"
        assert hello["allocator_settings"] == "max_split_size_mb:64,expandable_segments:True"
        # Twice at once: the cooldown, in one line.
        with pytest.raises(AgentError) as info:
            client.request("tune", {"set": {"expandable_segments": False}})
        assert info.value.code == protocol.E_RATE_LIMITED


def test_tune_with_empty_cache_releases_what_was_cached(
    agent: Agent, allocator: SimulatedCachingAllocator
):
    for block in [allocator.malloc(30 * MiB) for _ in range(3)]:
        allocator.free(block)
    with client_for(agent) as client, Stepper(agent):
        result = client.request(
            "tune",
            {"set": {"garbage_collection_threshold": 0.6}, "empty_cache": True},
            timeout=10,
        )
    assert result["reserved_before"] == {"0": 90 * MiB}
    assert result["reserved_after"] == {"0": 0}
    assert result["after"] == "max_split_size_mb:64,garbage_collection_threshold:0.6"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"set": {"backend": "cudaMallocAsync"}}, "cannot be changed in a running trainer"),
        ({"set": {"expandable_segments": "yes"}}, "True or False"),
        ({"set": {"max_split_size_mb": 4}}, "above 20"),
        ({"set": {}}, "'set' must be an object"),
        ({"set": "expandable_segments:True"}, "'set' must be an object"),
        ({"set": {"expandable_segments": True}, "empty_cache": "yes"}, "'empty_cache'"),
    ],
)
def test_bad_requests_are_refused_in_one_line(agent: Agent, args: dict, says: str):
    with client_for(agent) as client, Stepper(agent), pytest.raises(AgentError) as info:
        client.request("tune", args)
    assert info.value.code == protocol.E_BAD_REQUEST
    assert says in info.value.message and "\n" not in info.value.message


class NoSettingsProbe(SimulatedProbe):
    """A torch without torch._C._accelerator_setAllocatorSettings nor
    torch.cuda.memory._set_allocator_settings: the probe has no setter."""

    def __getattribute__(self, name: str):
        if name in ("set_allocator_settings", "allocator_settings"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_probe_without_the_api_is_refused_in_one_line(socket_dir: Path):
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(GiB), 0)
    server = sim_agent(socket_dir, NoSettingsProbe([SimulatedGpu(DEVICE, allocator)]))
    try:
        with client_for(server) as client, Stepper(server), pytest.raises(AgentError) as info:
            assert client.hello is not None and client.hello.allocator_settings is None
            client.request("tune", {"set": {"expandable_segments": True}})
        assert info.value.code == protocol.E_UNAVAILABLE
        assert "cannot change allocator settings while it runs" in info.value.message
    finally:
        server.stop()


def test_a_rocm_build_without_expandable_segments_is_refused(socket_dir: Path):
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(GiB), 0)
    probe = SimulatedProbe([SimulatedGpu(DEVICE, allocator)], hip="6.2.41133")
    server = sim_agent(socket_dir, probe)
    try:
        with client_for(server) as client, Stepper(server):
            with pytest.raises(AgentError) as info:
                client.request("tune", {"set": {"expandable_segments": True}})
            assert info.value.code == protocol.E_UNAVAILABLE
            assert "no expandable segments" in info.value.message
            # Another key is fine on ROCm.
            done = client.request("tune", {"set": {"max_split_size_mb": 128}}, timeout=10)
            assert done["after"] == "max_split_size_mb:128"
        assert allocator.config.expandable_segments is False
    finally:
        server.stop()
    assert alloc_conf.rocm_expandable_refusal("2.11.0+rocm7.2", "7.2.26015") is None
    assert alloc_conf.rocm_expandable_refusal("2.13.0+cu128", None) is None


class CapturingProbe(SimulatedProbe):
    def is_capturing(self) -> bool:
        return True  # a CUDA graph is captured at every boundary


def test_nothing_changes_under_a_graph_capture(socket_dir: Path):
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(GiB), 0)
    server = sim_agent(socket_dir, CapturingProbe([SimulatedGpu(DEVICE, allocator)]))
    try:
        with client_for(server) as client, Stepper(server), pytest.raises(AgentError) as info:
            client.request("tune", {"set": {"expandable_segments": True}, "wait_s": 0.5})
        assert info.value.code == protocol.E_UNAVAILABLE
        assert "CUDA graph was being captured" in info.value.message
        assert allocator.config.expandable_segments is False
        assert server.boundary.jobs_run == 0
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# The simulated allocator: new segments follow, cached ones keep their kind


def test_after_the_change_new_segments_are_expandable_and_old_ones_stay() -> None:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(4 * GiB), 0, "max_split_size_mb:64")
    old = allocator.malloc(30 * MiB)
    allocator.set_settings("max_split_size_mb:64,expandable_segments:True")
    new = allocator.malloc(50 * MiB)
    kinds = {s["address"]: s["is_expandable"] for s in allocator.memory_snapshot()}
    assert sorted(kinds.values()) == [False, True]
    assert any(a <= old < a + 30 * MiB and not e for a, e in kinds.items())
    assert any(a <= new and e for a, e in kinds.items())
    assert allocator.config.max_split_size == 64 * MiB
    with pytest.raises(ValueError):
        allocator.set_settings("expandable_segments:yes")  # as torch refuses it
    assert allocator.config.expandable_segments is True


# --------------------------------------------------------------------------------------------
# A real CPU torch trainer under `memtop run`, tuned with `memtop tune`

TRAINER = """
import time, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(6000):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    time.sleep(0.01)
"""


def memtop(*args: str, socket_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    return subprocess.run(
        [sys.executable, "-m", "memtop", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_a_real_torch_trainer_is_tuned_and_reads_its_settings_back(
    tmp_path: Path, socket_dir: Path
):
    torch = pytest.importorskip("torch")
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch cannot read its allocator settings back")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER))
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:256"
    env.pop("MEMTOP_AGENT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtop", "run", str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        settings = None
        while time.monotonic() < deadline and proc.poll() is None:
            if protocol.list_agent_sockets(socket_dir):
                # The agent listens before the program imports torch, whose import holds the
                # interpreter for seconds at a time on a loaded box: a hello took over 5 s with
                # two suites at once.  The test is about what the agent answers, not how soon.
                with AgentClient(proc.pid, socket_dir, timeout=20) as client:
                    hello = client.connect()
                    sample = client.request("sample")
                if sample.get("step") and hello.torch:
                    settings = sample.get("allocator_settings")
                    break
            time.sleep(0.3)
        assert settings == "max_split_size_mb:256", settings
        tuned = memtop(
            "tune", str(proc.pid), "expandable_segments=True", "--json", socket_dir=socket_dir
        )
        assert tuned.returncode == 0, tuned.stderr
        reply = json.loads(tuned.stdout)
        assert reply["before"] == "max_split_size_mb:256"
        # Read back from torch itself (_accelerator_getAllocatorSettings), not echoed.
        assert reply["after"] == "max_split_size_mb:256,expandable_segments:True"
        assert reply["after_step"] >= 1 and reply["thread"] == "MainThread"
        with AgentClient(proc.pid, socket_dir, timeout=5) as client:
            hello = client.connect()
            sample = client.request("sample")
        assert hello.allocator_conf == "max_split_size_mb:256"  # the environment's, unchanged
        assert hello.allocator_settings == "max_split_size_mb:256,expandable_segments:True"
        assert sample["allocator_settings"] == "max_split_size_mb:256,expandable_segments:True"
        # The text form: what changed and the step it ran after.  A refusal is one line.
        time.sleep(5.5)  # the agent's cooldown
        again = memtop("tune", str(proc.pid), "max_split_size_mb=128", socket_dir=socket_dir)
        assert again.returncode == 0, again.stderr
        assert "after step" in again.stdout
        assert "before: max_split_size_mb:256,expandable_segments:True" in again.stdout
        assert "after:  max_split_size_mb:128,expandable_segments:True" in again.stdout
        bad = memtop("tune", str(proc.pid), "roundup_power2_divisions=4", socket_dir=socket_dir)
        assert bad.returncode != 0 and "cannot be changed in a running trainer" in bad.stderr
        assert bad.stderr.count("\n") == 1
    finally:
        proc.kill()
        proc.communicate()


def test_the_settings_event_is_one_line_per_change() -> None:
    from memtop.engine.store import Store
    from memtop.model import AgentHello, AgentSample, AgentStatus, AgentView

    store = Store()
    hello = AgentHello(1, 4242, ("t.py",), "3.11", "2.13", "", (), allocator_settings="")

    def poll(settings: str) -> AgentView:
        sample = AgentSample(time.time(), 1, (), allocator_settings=settings)
        return AgentView(4242, AgentStatus.CONNECTED, hello, sample)

    store.update_agents([poll("")], time.time())
    store.update_agents([poll("expandable_segments:True")], time.time())
    store.update_agents([poll("expandable_segments:True")], time.time())
    view = store.view()
    (agent,) = view.agents
    assert agent.settings_in_force == "expandable_segments:True"
    changes = [text for _, text in view.events if "allocator settings" in text]
    assert changes == ["agent 4242 allocator settings: (default) → expandable_segments:True"]


_ = threading  # the Stepper's thread is the trainer's
