"""The trainer-side probe seam (issue 35 item 6): the agent sees torch through one interface
(memtop.agent.probe), each accelerator is one module of memtop.agent.backends chosen by its
registry, and every method says which thread may call it (DESIGN §6)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import tokenize
from pathlib import Path
from typing import Any

import pytest
from stepping import Stepper

from memtop.agent import probe as probe_module
from memtop.agent.probe import BackendExtras, DeviceBackend, Probe, interface_methods
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentClient, AgentError

HERE = Path(__file__).parent
MEMTOP = HERE.parent / "memtop"
MiB = 1 << 20
GiB = 1 << 30

# ------------------------------------------------------------------ a backend is one module

FAKE_TRAINER = """
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from torch import nn
import memtop
from memtop.agent import backends
from memtop.sources.agents import AgentClient

backends.register("fake_accelerator")  # the whole of plugging it in
import fake_accelerator

torch.manual_seed(0)
model = nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
agent = memtop.start_agent(argv=["train.py"])
out = {}

def until(ask, ok, within=30.0):
    # What is checked, waited for (a loaded box steps late), not a guessed sleep.
    deadline = time.monotonic() + within
    while not ok(reply := ask()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return reply

def ask():
    client = AgentClient(agent.pid, agent.directory, timeout=20.0)
    client.connect()
    out["hello"] = client.request("hello")
    out["sample"] = until(lambda: client.request("sample"), lambda r: r["step_marks"])
    # That sample asked the trainer's thread to measure free bytes at its next step.
    out["sample2"] = until(
        lambda: client.request("sample"),
        lambda r: r["devices"] and r["devices"][0]["free_measured_at"] is not None,
    )
    out["breakdown"] = client.request("breakdown", {"wait_s": 10.0})
    client.close()

asker = threading.Thread(target=ask, name="viewer")
asker.start()
while asker.is_alive():
    loss = model(torch.ones(2, 8)).sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    time.sleep(0.01)
out["calls"] = fake_accelerator.calls
out["agent_backend"] = type(agent.probe.real().backend).__module__
out["cuda_initialised"] = torch.cuda.is_initialized()
memtop.agent.stop_agent()
print(json.dumps(out))
"""


def test_a_registered_backend_module_serves_hello_and_sample_through_the_real_agent(
    socket_dir: Path, tmp_path: Path
) -> None:
    """tests/fake_accelerator.py is a backend no file of memtop knows: one register() call,
    and the agent a trainer starts (the lazy torch probe, over a CPU torch) serves its device
    and counters over its socket, its free bytes read on the trainer's thread."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(FAKE_TRAINER)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    env.pop("MEMTOP_BREAKDOWN_DEVICE", None)
    done = subprocess.run(
        [sys.executable, str(script), str(HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["agent_backend"] == "fake_accelerator"
    hello = out["hello"]
    assert hello["torch"] and hello["devices"] == [
        {
            "index": 0,
            "uuid": "FAKE-0000-0001",
            "name": "Fake Accelerator",
            "total_bytes": GiB,
            "pci_bus_id": "0000:42:00.0",
        }
    ]
    assert hello["hip"] is None and hello["allocator_settings"] is None  # it has no extras
    (device,) = out["sample2"]["devices"]
    assert device["stats"]["allocated_bytes.all.current"] == 3 * MiB
    assert device["stats"]["reserved_bytes.all.current"] == 8 * MiB
    # Free bytes as its mem_get_info says, measured at a step boundary (not total - reserved).
    assert device["free_bytes"] == GiB - 100 * MiB and device["free_measured_at"] is not None
    marks = out["sample"]["step_marks"]
    assert marks and all(m["allocated_bytes"] == {"0": 3 * MiB} for m in marks)
    # torch's side works over any backend: the breakdown walked the CPU parameters it names.
    parts = out["breakdown"]["devices"]["-1"]
    assert parts["parameters"] == (8 * 4 + 4) * 4 and parts["optimizer_state"] > 0
    # The trainer-thread methods ran on the trainer's (main) thread; the agent's threads only
    # read counters.
    for name, thread in out["calls"]:
        if probe_module.thread_rule(Probe, name) == "trainer":
            assert thread == "MainThread", (name, thread)
    assert {"mem_get_info", "is_capturing"} <= {name for name, _ in out["calls"]}
    assert any(thread == "memtop-agent" for _, thread in out["calls"])
    assert not out["cuda_initialised"]


def test_the_registry_asks_a_registered_module_first_and_skips_one_that_fails() -> None:
    pytest.importorskip("torch")
    from memtop.agent import backends

    backends.register("no_such_backend_module_here")
    backends.register("fake_accelerator")
    try:
        assert type(backends.select()).__module__ == "fake_accelerator"
        backends.unregister("fake_accelerator")
        # The broken one is passed over, and CUDA/ROCm, asked last, is the default.
        assert type(backends.select()).__module__ == "memtop.agent.backends.cuda"
        assert "no_such_backend_module_here" in backends.skipped
    finally:
        backends.unregister("fake_accelerator")
        backends.unregister("no_such_backend_module_here")
    assert backends.BACKENDS == ["memtop.agent.backends.cuda"]


# ------------------------------------------------------------------ the thread rules


def test_every_method_of_the_interface_says_which_thread_may_call_it() -> None:
    for interface in (Probe, DeviceBackend, BackendExtras):
        rules = interface_methods(interface)
        assert rules and all(rule in ("any", "trainer") for rule in rules.values()), rules
    # The ones DESIGN §6 names: whatever touches tensors or the device runtime.
    trainer = {n for n, r in interface_methods(Probe).items() if r == "trainer"}
    assert trainer == {"mem_get_info", "empty_cache", "snapshot", "breakdown", "is_capturing"}
    extras = interface_methods(BackendExtras)
    assert extras["set_allocator_settings"] == extras["record_history"] == "trainer"


def test_the_implementations_keep_the_interfaces_thread_marks() -> None:
    """A method the torch probe or the CUDA backend implements carries its interface's mark (a
    mark that disagreed would tell a reader the wrong thread)."""
    pytest.importorskip("torch")
    from memtop.agent.backends.cuda import CudaBackend
    from memtop.agent.torch_probe import TorchProbe

    interface = {**interface_methods(Probe), **interface_methods(BackendExtras)}
    for implementation in (TorchProbe, CudaBackend):
        found = 0
        for name, rule in interface.items():
            method = vars(implementation).get(name)
            if method is None:
                continue
            found += 1
            assert getattr(method, "__memtop_thread__", None) == rule, (implementation, name)
        assert found >= 8, implementation


class ThreadRecordingProbe:
    """Any probe, with the thread of every call of a method written down."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_"):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            return value(*args, **kwargs)

        return call


def test_the_agents_own_threads_never_call_a_trainer_thread_method(
    socket_dir: Path, tmp_path: Path
) -> None:
    """Every command a viewer can send, against a probe that notes the thread of each call:
    no method the interface marks `trainer_thread` ran on the agent's thread or its worker."""
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    held = [allocator.malloc(n * MiB) for n in (3, 40, 7)]
    device = probe_module.ProbeDevice(0, "GPU-00000000-0000-0000-0000-0000000000e1", "Sim", 8 * GiB)
    probe = ThreadRecordingProbe(SimulatedProbe([SimulatedGpu(device, allocator)]))
    agent = Agent(probe, socket_dir, argv=["train.py"])  # type: ignore[arg-type]
    agent.start()
    asked: dict[str, str] = {}
    client = AgentClient(agent.pid, agent.directory, timeout=10.0)
    try:
        with Stepper(agent, period=0.005), client:
            client.connect()
            for cmd, args in [
                ("hello", {}),
                ("sample", {}),
                ("breakdown", {"wait_s": 5.0}),
                ("snapshot", {"wait_s": 5.0}),
                ("snapshot", {"path": str(tmp_path / "s.pickle"), "wait_s": 5.0}),
                ("cleanup", {"wait_s": 5.0}),
                ("reset_peak", {}),
                ("tune", {"set": {"max_split_size_mb": 256}, "empty_cache": True}),
                ("sites", {"stacks": True}),
                ("sample", {}),
            ]:
                try:
                    client.request(cmd, args, timeout=10)
                    asked[cmd] = "ok"
                except AgentError as exc:
                    asked[cmd] = exc.code
                time.sleep(0.2)
    finally:
        agent.stop()
    del held
    rules = {**interface_methods(Probe), **interface_methods(BackendExtras)}
    trainer_calls = [(n, t) for n, t in probe.calls if rules.get(n) == "trainer"]
    called = {n for n, _ in trainer_calls}
    assert {"mem_get_info", "empty_cache", "snapshot", "breakdown", "is_capturing"} <= called, asked
    assert {"set_allocator_settings", "record_history"} <= called, asked
    agent_threads = {"memtop-agent", "memtop-agent-io"}
    assert not [c for c in trainer_calls if c[1] in agent_threads], trainer_calls
    assert all(t == "trainer" for _, t in trainer_calls), trainer_calls
    # ... while the agent thread did read the counters itself.
    assert ("memory_stats", "memtop-agent") in probe.calls
    assert all(rules.get(n) is not None for n, _ in probe.calls), probe.calls


# ------------------------------------------------------------------ one home for torch.cuda


def _names_torch_cuda(path: Path) -> list[int]:
    """Lines of `path` whose code (not its comments or strings) names torch.cuda or one of
    torch._C's CUDA functions (`_cuda_...`)."""
    text = path.read_text()
    if "cuda" not in text:
        # Either needs a name token holding "cuda": a file without it names neither, and
        # tokenizing the two thirds of memtop's source that have none was most of the check.
        return []
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type in (tokenize.NAME, tokenize.OP)
    ]
    lines = []
    for before, dot, name in zip(tokens, tokens[1:], tokens[2:], strict=False):
        if dot.string != ".":
            continue
        if (before.string, name.string) == ("torch", "cuda") or name.string.startswith("_cuda"):
            lines.append(name.start[0])
    return lines


def test_only_the_cuda_backend_names_torch_cuda() -> None:
    found = {
        str(path.relative_to(MEMTOP)): lines
        for path in sorted(MEMTOP.rglob("*.py"))
        if (lines := _names_torch_cuda(path))
    }
    assert set(found) == {"agent/backends/cuda.py"}, found
    assert len(found["agent/backends/cuda.py"]) >= 20  # the ~25 references it holds


def test_the_seam_check_would_see_a_stray_reference(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text(
        textwrap.dedent("""\
            import torch
            # torch.cuda in a comment is fine
            x = "torch.cuda"
            if torch.cuda.is_initialized():
                torch._C._cuda_memoryStats(0)
        """)
    )
    assert _names_torch_cuda(stray) == [4, 5]


LATE_TORCH = """
import sys
from memtop.agent.lazy_probe import LazyTorchProbe

probe = LazyTorchProbe()
seen = []
assert "torch" not in sys.modules
print("before", probe.attach_oom_observer(lambda *a: None))  # `memtop run`: no torch yet
import torch  # the program's own import
from memtop.agent.backends import cuda

attached = []
cuda.CudaBackend.attach_oom_observer = lambda self, observer: attached.append(observer) or True
probe.devices()  # the agent's next sample makes the real probe
print("attached", len(attached))
"""


def test_an_oom_observer_asked_for_before_torch_is_imported_is_attached_after() -> None:
    # Under `memtop run` the agent starts before the program imports torch: the observer asked
    # for at start used to be dropped (getattr on the lazy probe raised), so no OOM report.
    out = subprocess.run(
        [sys.executable, "-c", LATE_TORCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["before", "True", "attached", "1"]
