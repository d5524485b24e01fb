"""The real probe, `memtop.agent.torch_probe.TorchProbe`, on the installed torch.

Without a GPU (the CPU build of torch): the probe sees no devices, never initialises CUDA, and
counts real optimizer steps, which an agent serves to a viewer; `memtop run` on the example
trainer is visible to a viewer.  Tests marked `gpu` run the probe on CUDA and are skipped
without one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from stepping import Stepper  # noqa: E402
from torch import nn  # noqa: E402

from memtop import protocol  # noqa: E402
from memtop.agent.server import Agent  # noqa: E402
from memtop.agent.torch_probe import TorchProbe  # noqa: E402
from memtop.sources.agents import AgentClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def probe() -> Iterator[TorchProbe]:
    probe = TorchProbe()
    yield probe
    probe.remove_step_hook()  # torch's step post-hooks are process-global


@pytest.fixture
def cuda_untouched() -> None:
    # The in-process CPU tests need a process where nothing has initialised CUDA yet; the
    # subprocess test below checks the same on any machine.
    if torch.cuda.is_initialized():
        pytest.skip("CUDA was already initialised in this process by another test")


def tiny_model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)


def train(model: nn.Module, optimizer: Any, steps: int, device: str = "cpu") -> None:
    for _ in range(steps):
        x = torch.randn(4, 8, device=device)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def start_agent(probe: TorchProbe, socket_dir: Path) -> Agent:
    agent = Agent(probe, directory=socket_dir)
    agent.start()
    assert probe.install_step_hook(agent.on_step)
    return agent


# ------------------------------------------------------------------------- CPU-only torch


def test_probe_sees_no_device_and_never_initialises_cuda(probe: TorchProbe, cuda_untouched):
    calls = {
        "torch_version": probe.torch_version,
        "allocator_conf": probe.allocator_conf,
        "devices": probe.devices,
        "snapshot": probe.snapshot,
        "breakdown": probe.breakdown,
    }
    for name, call in calls.items():
        call()
        assert not torch.cuda.is_initialized(), f"{name}() initialised CUDA"
    assert probe.devices() == []
    assert probe.torch_version() == torch.__version__
    assert probe.breakdown() == {}


def test_snapshot_without_cuda_has_no_segments(probe: TorchProbe, cuda_untouched):
    snapshot = probe.snapshot()
    assert snapshot["segments"] == []
    assert snapshot["device_traces"] == []
    assert not torch.cuda.is_initialized()


def test_allocator_conf_is_read_from_the_environment(probe, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert probe.allocator_conf() == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert probe.allocator_conf() == "max_split_size_mb:128"


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        lambda params: torch.optim.Adam(params, lr=1e-3),
    ],
    ids=["sgd", "adam"],
)
def test_step_hook_counts_real_optimizer_steps(probe: TorchProbe, make_optimizer):
    steps = []
    assert probe.install_step_hook(lambda: steps.append(1))
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    train(model, make_optimizer(model.parameters()), 7)
    assert len(steps) == 7
    # The hook did not get in the way of the update itself.
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_step_hook_counts_only_the_first_of_two_optimizers(probe: TorchProbe):
    steps = []
    probe.install_step_hook(lambda: steps.append(1))
    generator, discriminator = tiny_model(), tiny_model()
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-2)
    for _ in range(5):  # a GAN-like loop: two optimizer steps per training step
        train(generator, opt_g, 1)
        train(discriminator, opt_d, 1)
    assert len(steps) == 5
    train(discriminator, opt_d, 4)  # extra steps of the second optimizer alone do not count
    assert len(steps) == 5
    train(generator, opt_g, 2)
    assert len(steps) == 7


def test_step_hook_follows_an_optimizer_that_replaces_a_deleted_one(probe: TorchProbe):
    steps = []
    probe.install_step_hook(lambda: steps.append(1))
    model = tiny_model()
    first = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, first, 3)
    del first  # a new phase builds a new optimizer; the old one is gone
    import gc

    gc.collect()
    train(model, torch.optim.Adam(model.parameters(), lr=1e-4), 4)
    assert len(steps) == 7


def test_step_hook_never_raises_into_the_trainer(probe: TorchProbe):
    def broken() -> None:
        raise RuntimeError("viewer side bug")

    probe.install_step_hook(broken)
    model = tiny_model()
    train(model, torch.optim.SGD(model.parameters(), lr=0.01), 2)  # must not raise


def test_removed_step_hook_counts_nothing(probe: TorchProbe):
    steps = []
    probe.install_step_hook(lambda: steps.append(1))
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, optimizer, 2)
    probe.remove_step_hook()
    train(model, optimizer, 3)
    assert len(steps) == 2


def test_installing_the_step_hook_twice_counts_each_step_once(probe: TorchProbe):
    steps = []
    probe.install_step_hook(lambda: steps.append(1))
    probe.install_step_hook(lambda: steps.append(1))
    model = tiny_model()
    train(model, torch.optim.SGD(model.parameters(), lr=0.01), 3)
    assert len(steps) == 3


def test_memory_allocated_without_cuda_is_zero(probe: TorchProbe, cuda_untouched):
    assert probe.memory_allocated(0) == 0
    assert not torch.cuda.is_initialized()


def test_breakdown_ignores_cpu_tensors(probe: TorchProbe):
    probe.install_step_hook(lambda: None)
    model = tiny_model()
    train(model, torch.optim.Adam(model.parameters()), 2)
    assert probe.breakdown() == {}  # the probe reports CUDA memory only


def test_agent_serves_hello_and_step_marks_of_real_steps(probe: TorchProbe, socket_dir: Path):
    agent = start_agent(probe, socket_dir)
    agent.boundary.mark_interval_s = 0.0  # a mark at every step (they are rate-limited by time)
    try:
        with AgentClient(os.getpid(), directory=socket_dir) as client:
            hello = client.connect()
            assert hello.protocol == protocol.PROTOCOL_VERSION
            assert hello.pid == os.getpid()
            assert hello.torch == torch.__version__
            if not torch.cuda.is_initialized():
                assert hello.devices == ()
            first = client.sample()
            assert first.step is None and first.step_marks == ()

            model = tiny_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            train(model, optimizer, 5)
            sample = client.sample()
            assert sample.step == 5
            assert [m.step for m in sample.step_marks] == [1, 2, 3, 4, 5]
            assert all(abs(m.time - time.time()) < 60 for m in sample.step_marks)

            train(model, optimizer, 3)
            sample = client.sample()
            assert sample.step == 8
            assert [m.step for m in sample.step_marks] == [6, 7, 8]  # only the new ones
            if not torch.cuda.is_initialized():
                assert sample.devices == ()
                assert all(m.allocated == {} for m in sample.step_marks)
                # Measured on this (the trainer's) thread at a step: pending until one comes.
                assert client.request("breakdown")["devices"] == {}
                assert client.request("snapshot")["devices"] == {}
                assert client.request("reset_peak")["devices"] == []  # (+ its action_seq)
    finally:
        agent.stop()
    assert not (socket_dir / f"{os.getpid()}.sock").exists()


NO_CUDA_INIT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    from memtop.agent.server import Agent
    from memtop.agent.torch_probe import TorchProbe
    from memtop.sources.agents import AgentClient

    seen = {}
    def check(name):
        seen[name] = torch.cuda.is_initialized()

    probe = TorchProbe()
    for name in ("torch_version", "allocator_conf", "devices", "snapshot", "breakdown"):
        getattr(probe, name)()
        check(name)
    agent = Agent(probe, directory=__import__("pathlib").Path(sys.argv[1]))
    agent.start()
    probe.install_step_hook(agent.on_step)
    check("install_step_hook")
    client = AgentClient(os.getpid(), directory=agent.directory, timeout=10)
    hello = client.connect()
    check("hello")
    import threading
    from memtop.sources.agents import AgentError
    try:
        client.request("cleanup")  # no step yet: refused, since it must run between steps
    except AgentError as exc:
        refused = exc.code
    check("cleanup refused")
    answer = {}
    def ask_cleanup():
        with AgentClient(os.getpid(), directory=agent.directory, timeout=10) as other:
            other.connect()
            answer.update(other.request("cleanup"))
    asker = threading.Thread(target=ask_cleanup)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())
    steps = 0
    while asker.is_alive() or steps < 3:
        if steps == 1:
            asker.start()  # once the trainer steps, cleanup waits for the next boundary
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        steps += 1
        __import__("time").sleep(0.01)
    check("step hook")
    check("cleanup")
    cleanup = answer
    sample = client.sample()
    check("sample")
    for cmd in ("breakdown", "snapshot", "reset_peak"):
        client.request(cmd)
        check(cmd)
    agent.stop()
    print(json.dumps({"initialised": seen, "devices": list(hello.devices), "step": sample.step,
                      "released": cleanup["released_bytes"], "refused": refused,
                      "steps": steps}))
    """
)


NO_CUDA_INIT_TEST = "test_no_probe_or_agent_call_initialises_cuda_in_a_fresh_process"


@pytest.fixture(scope="module", autouse=True)
def no_cuda_init_run(request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str] | None]:
    """The fresh process of the no-CUDA test, started with the module when that test is to run:
    it imports torch (seconds of CPU, longer on a loaded box) while the tests before it run."""
    if not any(item.name == NO_CUDA_INIT_TEST for item in request.session.items):
        yield None
        return
    directory = Path(tempfile.mkdtemp(prefix="mtnc-", dir="/tmp"))
    directory.chmod(0o700)
    # A fresh process, so that this holds on a GPU machine too, where CUDA is available but
    # the trainer (here: a CPU model) never touched it.
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    process = subprocess.Popen(
        [sys.executable, "-c", NO_CUDA_INIT_SCRIPT, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_no_probe_or_agent_call_initialises_cuda_in_a_fresh_process(
    no_cuda_init_run: subprocess.Popen[str],
):
    stdout, stderr = no_cuda_init_run.communicate(timeout=60)
    assert no_cuda_init_run.returncode == 0, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["initialised"], report
    assert not any(report["initialised"].values()), report["initialised"]
    assert report["devices"] == []
    assert report["step"] == report["steps"] >= 3
    assert report["released"] == {}
    assert report["refused"] == "unavailable"


def test_memtop_run_example_is_visible_to_a_viewer(socket_dir: Path):
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "memtop.cli", "run", "examples/train_cpu.py"]
    command += ["--steps", "300", "--step-time", "0.005", "--device", "cpu"]
    trainer = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        sock = socket_dir / f"{trainer.pid}.sock"
        # A guard against a hang, not a bound: importing torch and its first optimizer step
        # (which imports torch._dynamo, ~2 CPU-s) took over 30 s with two suites at once.
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert trainer.poll() is None, trainer.communicate()
            assert time.monotonic() < deadline, "the agent socket never appeared"
            time.sleep(0.02)
        # A torch trainer on a box running the suite in workers may take over the client's
        # default 2 s to answer; the test is about what it answers.
        with AgentClient(trainer.pid, directory=socket_dir, timeout=15) as client:
            hello = client.connect()
            assert hello.pid == trainer.pid
            # The agent starts before the program imports torch (memtop run loads no torch
            # itself); its hello names torch once the program has imported it.
            while hello.torch is None:
                assert time.monotonic() < deadline, "hello never named torch"
                time.sleep(0.1)
                hello = client.refresh_hello()
            assert hello.torch == torch.__version__
            assert hello.devices == ()
            assert hello.argv[0] == "examples/train_cpu.py"  # the program, not memtop
            first = client.sample()
            while first.step is None:
                assert time.monotonic() < deadline, "no optimizer step was ever counted"
                time.sleep(0.05)
                first = client.sample()
            marks = []
            second = first
            # A few steps later (well before step 300), and at least one mark: marks are taken
            # at most every MARK_MIN_INTERVAL_S, so the first sample after a step may hold none.
            while second.step == first.step or not marks:
                assert time.monotonic() < deadline, "the step count stopped moving"
                time.sleep(0.05)
                second = client.sample()
                marks += [m.step for m in second.step_marks]
            assert second.step is not None and second.step > first.step
            # Marks of the steps in between reached the viewer once each, in order; at 200
            # steps a second they are taken at most every MARK_MIN_INTERVAL_S, not every step.
            assert marks and marks == sorted(set(marks))
            # The step's count goes up just before its mark is kept (the trainer's thread, while
            # the agent's thread answers): a sample between them says step N and the next one
            # carries mark N (seen once under workers).  Once each, never one from before.
            assert first.step <= marks[0] and marks[-1] <= second.step
        out, err = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert trainer.returncode == 0, err
    assert "step 300" in out
    assert "agent listening on" in err
    assert not sock.exists()  # the agent removed its socket at exit


# ------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@needs_cuda
def test_gpu_stats_and_devices_agree_with_torch(probe: TorchProbe):
    index = torch.cuda.current_device()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device=f"cuda:{index}")
    torch.cuda.synchronize()
    stats = probe.memory_stats(index)
    assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated(index) >= 64 * MiB
    assert stats["reserved_bytes.all.current"] == torch.cuda.memory_reserved(index)
    assert probe.memory_allocated(index) == torch.cuda.memory_allocated(index)
    free, total = probe.mem_get_info(index)
    assert total == torch.cuda.mem_get_info(index)[1] and 0 < free < total
    props = torch.cuda.get_device_properties(index)
    device = {d.index: d for d in probe.devices()}[index]
    # torch's UUID as it gives it (no `GPU-` prefix added: a MIG instance's would not match)
    assert device.uuid == str(props.uuid) and len(device.uuid) > 20
    assert device.name == props.name
    assert device.total_bytes == props.total_memory
    del x


@pytest.mark.gpu
@needs_cuda
def test_gpu_snapshot_has_segments_and_loads_with_memory_viz(
    probe: TorchProbe, socket_dir: Path, tmp_path: Path
):
    from torch.cuda import _memory_viz

    x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    assert probe.snapshot()["segments"]
    agent = start_agent(probe, socket_dir)
    try:
        # A snapshot runs between two steps on the trainer's thread (the agent's rework): the
        # Stepper is that thread here.
        with Stepper(agent), AgentClient(os.getpid(), directory=socket_dir) as client:
            client.connect()
            path = tmp_path / "snapshot.pickle"
            result = client.request("snapshot", {"path": str(path)}, timeout=60)
    finally:
        agent.stop()
    summary = result["devices"][str(x.device.index)]
    assert summary["segments"] >= 1
    assert summary["allocated_bytes"] >= 32 * MiB
    with open(path, "rb") as fh:
        data = pickle.load(fh)
    text = _memory_viz.segsum(data)
    assert "total_reserved" in text
    assert sum(seg["total_size"] for seg in data["segments"]) == torch.cuda.memory_reserved()
    del x


@pytest.mark.gpu
@needs_cuda
def test_gpu_cleanup_through_the_agent_releases_cached_memory(probe, socket_dir: Path):
    index = torch.cuda.current_device()
    x = torch.empty(256 * MiB, dtype=torch.uint8, device=f"cuda:{index}")
    del x  # freed, but still cached by the allocator
    reserved_before = torch.cuda.memory_reserved(index)
    assert reserved_before >= 256 * MiB
    agent = start_agent(probe, socket_dir)
    try:
        with Stepper(agent), AgentClient(os.getpid(), directory=socket_dir) as client:
            client.connect()
            result = client.request("cleanup", timeout=30)  # at the Stepper's next boundary
    finally:
        agent.stop()
    assert result["released_bytes"][str(index)] >= 256 * MiB
    assert torch.cuda.memory_reserved(index) <= reserved_before - 256 * MiB


@pytest.mark.gpu
@needs_cuda
def test_gpu_breakdown_counts_parameters_gradients_and_adam_state(probe: TorchProbe):
    width = 1024
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    probe.install_step_hook(lambda: None)  # the probe finds optimizers through the hook
    for _ in range(2):
        x = torch.randn(32, width, device="cuda")
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    del x, loss
    torch.cuda.synchronize()
    index = torch.cuda.current_device()
    # Computed from the architecture, not from the tensors the probe walks.
    param_bytes = 2 * (width * width + width) * 4
    # AdamW keeps exp_avg and exp_avg_sq per parameter; `step` lives on the CPU unless the
    # optimizer is capturable or fused, in which case it is one float32 per parameter on the GPU.
    step_bytes = sum(
        4
        for state in optimizer.state.values()
        if torch.is_tensor(state.get("step")) and state["step"].is_cuda
    )
    breakdown = probe.breakdown()[index]
    assert breakdown.parameters == param_bytes
    assert breakdown.gradients == param_bytes
    assert breakdown.optimizer_state == 2 * param_bytes + step_bytes
    assert breakdown.fp32_parameter_bytes == param_bytes
    assert breakdown.allocated == torch.cuda.memory_allocated(index)
    assert breakdown.other == breakdown.allocated - 4 * param_bytes - step_bytes


SECOND_DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, pathlib
    import torch
    from memtop.agent.server import Agent
    from memtop.agent.torch_probe import TorchProbe
    from memtop.sources.agents import AgentClient

    x = torch.ones(1 << 20, device="cuda:0")  # the trainer uses device 0 only
    probe = TorchProbe()
    agent = Agent(probe, directory=pathlib.Path(sys.argv[1]))
    agent.start()
    probe.install_step_hook(agent.on_step)
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    opt.step()
    client = AgentClient(os.getpid(), directory=agent.directory)
    hello = client.connect()
    client.sample()
    for cmd in ("breakdown", "snapshot", "reset_peak", "cleanup"):
        client.request(cmd, timeout=30)
    agent.stop()
    print(json.dumps({
        "devices": [d.index for d in hello.devices],
        "contexts": [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())],
    }))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_gpu_probe_creates_no_context_on_a_device_the_trainer_does_not_use(socket_dir: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-c", SECOND_DEVICE_SCRIPT, str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == [0]
    assert report["contexts"][0] is True
    assert not any(report["contexts"][1:]), report["contexts"]
