"""The HF and Lightning callbacks on a tiny real training run on CPU (random init, no download):
memtop's step is the framework's `global_step` (gradient accumulation included) and the phases
it says are the ones the trainer went through."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memtop.agent  # noqa: E402
from memtop.sources.agents import AgentClient  # noqa: E402


@pytest.fixture
def fresh_agent() -> Iterator[None]:
    memtop.agent.stop_agent()
    yield
    memtop.agent.stop_agent()


def phases_seen() -> list[str]:
    agent = memtop.agent.current_agent()
    assert agent is not None
    return [phase for _, _, phase in agent.boundary.phase_changes]


def test_hf_callback_counts_global_steps_and_phases(fresh_agent, socket_dir: Path, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    from memtop.integrations.hf import MemtopCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.data = torch.randint(0, 64, (n, 16))

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.data[i], "labels": self.data[i]}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,  # 4 batches a step: steps are optimizer updates
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(64),
        eval_dataset=Tokens(4),
        callbacks=[MemtopCallback(socket_dir=socket_dir)],
    )
    agent = memtop.agent.current_agent()
    assert agent is not None, "the callback starts the agent when the Trainer is built"
    agent.boundary.mark_interval_s = 0.0  # a mark at every step
    with AgentClient(os.getpid(), directory=socket_dir) as client:
        client.connect()
        client.sample()
        trainer.train()
        sample = client.sample()
    assert trainer.state.global_step == 6
    assert sample.step == trainer.state.global_step
    assert [m.step for m in sample.step_marks] == [1, 2, 3, 4, 5, 6]
    seen = phases_seen()
    assert "eval" in seen and "save" in seen and seen[-1] == "idle"
    # Eval at step 3 and 6, save at 4: train resumes after each.
    assert seen.index("eval") < seen.index("save")


def test_lightning_callback_counts_global_steps_and_phases(fresh_agent, socket_dir: Path):
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning", reason="lightning is not installed")
    from memtop.integrations.lightning import MemtopCallback

    torch.manual_seed(0)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, idx):
            x, y = batch
            self.log("val", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # 12 batches an epoch
    trainer = pl.Trainer(
        max_epochs=2,
        accumulate_grad_batches=3,  # 4 optimizer updates an epoch
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[MemtopCallback(socket_dir=socket_dir)],
    )
    module = Tiny()
    trainer.fit(module, loader, loader)
    agent = memtop.agent.current_agent()
    assert agent is not None
    assert trainer.global_step == 8
    assert agent.step == trainer.global_step
    seen = phases_seen()
    assert seen.count("eval") == 2 and seen[-1] == "idle"


def test_integrations_import_no_framework():
    code = (
        "import sys, memtop, memtop.integrations; "
        "names = ('transformers', 'lightning', 'pytorch_lightning'); "
        "bad = [m for m in names if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------- without the frameworks (CI)


@pytest.fixture
def sim_agent(fresh_agent, socket_dir: Path) -> Iterator[memtop.agent.server.Agent]:
    from memtop.agent.probe import ProbeDevice
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.probe import SimulatedGpu, SimulatedProbe

    allocator = SimulatedCachingAllocator(LocalDeviceMemory(1 << 30), 0)
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000003", "Sim GPU", 1 << 30)
    agent = memtop.agent.start_agent(
        probe=SimulatedProbe([SimulatedGpu(device, allocator)]), socket_dir=socket_dir
    )
    assert agent is not None
    agent.boundary.mark_interval_s = 0.0
    yield agent


def test_sync_step_adopts_the_framework_count_and_is_the_boundary_without_a_hook(sim_agent):
    boundary = sim_agent.boundary
    memtop.sync_step(1)  # no optimizer hook counted it: this is the step boundary
    assert boundary.step == 1 and [m["step"] for _, m in boundary.marks] == [1]
    memtop.sync_step(1)  # the same update told twice (Lightning's per-batch hook)
    assert boundary.step == 1 and len(boundary.marks) == 1
    boundary.on_step()  # the optimizer hook counts an update ...
    memtop.sync_step(1000)  # ... that the framework numbers 1000 (resumed from a checkpoint)
    assert boundary.step == 1000 and [m["step"] for _, m in boundary.marks] == [1, 2]
    boundary.on_step()
    memtop.sync_step(1001)
    assert boundary.step == 1001 and len(boundary.marks) == 3


def test_phase_is_recorded_and_served(sim_agent, socket_dir: Path):
    memtop.phase("eval")
    memtop.phase("eval")  # no change, no entry
    memtop.phase("train")
    assert [p for _, _, p in sim_agent.boundary.phase_changes] == ["eval", "train"]
    memtop.phase("save")
    with AgentClient(os.getpid(), directory=socket_dir) as client:
        client.connect()
        raw = client.request("sample")
    assert raw["phase"] == "save" and raw["oom"]["ooms"] == 0


def test_phase_and_sync_step_without_an_agent_do_nothing(fresh_agent):
    memtop.phase("eval")
    memtop.sync_step(3)
    memtop.step()
    assert memtop.agent.current_agent() is None


class _Control:
    def __init__(self, evaluate: bool = False, save: bool = False) -> None:
        self.should_evaluate, self.should_save = evaluate, save


class _State:
    def __init__(self, step: int) -> None:
        self.global_step = step


def test_hf_callback_logic_with_a_stand_in_transformers(sim_agent, monkeypatch, request):
    """The callback's own logic where transformers is not installed: a stand-in base class."""
    import types

    stub = types.ModuleType("transformers")
    stub.TrainerCallback = type("TrainerCallback", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", stub)
    monkeypatch.delitem(sys.modules, "memtop.integrations.hf", raising=False)
    # Built on the stand-in: never left for a later import to find.
    request.addfinalizer(lambda: sys.modules.pop("memtop.integrations.hf", None))
    from memtop.integrations.hf import MemtopCallback

    callback = MemtopCallback()
    callback.on_init_end(None, _State(0), _Control())
    callback.on_train_begin(None, _State(0), _Control())
    for step in (1, 2, 3):  # accumulation steps give no on_step_end: one per update
        callback.on_step_begin(None, _State(step - 1), _Control())
        callback.on_step_end(None, _State(step), _Control(evaluate=step == 2, save=step == 3))
        if step == 2:
            callback.on_prediction_step(None, _State(step), _Control())
            callback.on_evaluate(None, _State(step), _Control())
        if step == 3:
            callback.on_save(None, _State(step), _Control())
    callback.on_train_end(None, _State(3), _Control())
    assert sim_agent.boundary.step == 3
    phases = [p for _, _, p in sim_agent.boundary.phase_changes]
    assert phases == ["eval", "train", "save", "train", "idle"]


def test_lightning_callback_logic_with_a_stand_in_lightning(sim_agent, monkeypatch, request):
    import types

    root, pytorch, callbacks = (
        types.ModuleType(n)
        for n in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks")
    )
    callbacks.Callback = type("Callback", (), {})  # type: ignore[attr-defined]
    for name, module in (
        ("lightning", root),
        ("lightning.pytorch", pytorch),
        ("lightning.pytorch.callbacks", callbacks),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "memtop.integrations.lightning", raising=False)
    # Built on the stand-in: never left for a later import to find.
    request.addfinalizer(lambda: sys.modules.pop("memtop.integrations.lightning", None))
    from memtop.integrations.lightning import MemtopCallback

    trainer = types.SimpleNamespace(global_step=0)
    callback = MemtopCallback()
    callback.setup(trainer, None, "fit")
    callback.on_fit_start(trainer, None)
    for batch in range(6):  # accumulate 2: an update every second batch
        callback.on_train_batch_start(trainer, None, None, batch)
        trainer.global_step += batch % 2
        callback.on_train_batch_end(trainer, None, None, None, batch)
    callback.on_validation_start(trainer, None)
    callback.on_validation_end(trainer, None)
    callback.on_save_checkpoint(trainer, None, {})
    callback.on_fit_end(trainer, None)
    assert sim_agent.boundary.step == trainer.global_step == 3
    phases = [p for _, _, p in sim_agent.boundary.phase_changes]
    assert phases == ["eval", "train", "save", "idle"]
