"""`memtop estimate` against published numbers and memtop's own measurements on an H100."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.estimate.architecture import (
    PRESETS,
    Architecture,
    assumed_shape,
    from_hf_config,
    load_hf_config,
)
from memtop.estimate.memory import Setup, estimate, max_batch, usable_bytes
from memtop.estimate.reference import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from memtop.figures.units import GiB

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "cuda-h100"
if not TRACES.is_dir():
    TRACES = Path("/work/shared/traces/cuda-h100")

LLAMA_7B_PARAMS = 6_738_415_616  # the published count of LLaMA-7B


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def within(value: float, expected: float, share: float) -> bool:
    return abs(value - expected) <= share * expected


def test_presets_have_the_published_parameter_counts():
    assert PRESETS["llama-7b"].parameter_count() == LLAMA_7B_PARAMS
    assert within(PRESETS["llama-13b"].parameter_count(), 13_015_864_320, 0.0001)
    assert within(PRESETS["llama-70b"].parameter_count(), 68_976_648_192, 0.0001)
    assert PRESETS["gpt2"].parameter_count() == 124_439_808


def test_llama_7b_bf16_adamw(capsys):
    out = run_json(
        capsys, "--preset", "llama-7b", "--dtype", "bf16", "--optimizer", "adamw", "--gpu", "h100"
    )
    p = out["parameters_count"]
    assert p == LLAMA_7B_PARAMS
    assert within(out["weights_bytes"], 2 * p, 0.02)
    assert within(out["gradients_bytes"], 2 * p, 0.02)
    # torch's AdamW keeps bf16 moments for bf16 parameters (test_optimizer_state_matches_torch).
    assert within(out["optimizer_state_bytes"], 4 * p, 0.01)
    # The seeds' table: 14 GB of bf16 weights.
    assert within(out["weights_bytes"], 14e9, 0.05)
    parts = ("weights", "gradients", "optimizer_state", "activations", "overhead")
    assert out["total_bytes"] == sum(out[f"{k}_bytes"] for k in parts)
    # Pure bf16 AdamW (bf16 moments) fits an 80 GB GPU at a small batch; with fp32 master
    # weights (16 bytes a parameter) 7B does not fit even at batch 1.
    assert out["fits"] is True and out["max_batch"] >= 1
    assert out["targets"][0]["name"] == "h100-80gb"
    mixed = run_json(capsys, "--preset", "llama-7b", "--master-weights", "--gpu", "h100")
    assert mixed["fits"] is False and mixed["max_batch"] == 0


def test_qlora_base_and_8bit_adam(capsys):
    out = run_json(capsys, "--preset", "llama-7b", "--qlora", "--lora-rank", "64")
    assert within(out["details"]["base_bytes"], 3.5e9, 0.15)
    assert out["trainable_parameters_count"] == 64 * 2 * (4096 + 4096) * 32  # q_proj, v_proj
    assert out["gradients_bytes"] == 4 * out["trainable_parameters_count"]  # fp32 adapters
    eight = run_json(capsys, "--preset", "llama-7b", "--optimizer", "adamw-8bit")
    assert within(eight["optimizer_state_bytes"], 2 * LLAMA_7B_PARAMS, 0.02)
    assert within(eight["optimizer_state_bytes"], 14e9, 0.05)


def _measured_breakdown(name: str) -> dict[str, int]:
    """A breakdown taken while the gradients were alive (that recording's agent walked the
    optimizer from its own thread, so some of its breakdowns saw them freed)."""
    path = TRACES / f"{name}.jsonl.gz"
    best: dict[str, int] | None = None
    with gzip.open(path, "rt") as f:
        for line in f:
            record = json.loads(line)
            result = (record.get("reply") or {}).get("result") or {}
            devices = result.get("devices")
            if (
                record.get("cmd") == "breakdown"
                and isinstance(devices, dict)
                and devices
                and (best is None or devices["0"]["gradients"] > best["gradients"])
            ):
                best = devices["0"]
    assert best is not None and best["gradients"] > 0, f"no breakdown with gradients in {path}"
    return best


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_matches_the_h100_recordings_breakdown(capsys, tmp_path):
    measured = _measured_breakdown("healthy")
    # shared/gpu/train_gpt.py's model, described as a GPT-2 config.json would.
    config = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 32000,
        "n_positions": 0,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source in (["--preset", "memtop-gpt-134m"], ["--config", str(tmp_path)]):
        out = run_json(
            capsys, *source, "--dtype", "fp32", "--autocast", "--batch", "8", "--seq", "512"
        )
        assert within(out["weights_bytes"], measured["parameters"], 0.02)
        assert within(out["gradients_bytes"], measured["gradients"], 0.02)
        assert within(out["optimizer_state_bytes"], measured["optimizer_state"], 0.02)


def test_zero_stages_match_the_zero_paper():
    # Rajbhandari et al. 2020, Figure 1: 7.5 B parameters, 64 GPUs, mixed-precision Adam (K=12).
    arch = assumed_shape(7_500_000_000)
    expected = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}
    for stage, total in expected.items():
        est = estimate(arch, Setup(dtype="bf16", master_weights=True, zero_stage=stage, gpus=64))
        # (the paper rounds 120 GB / 64 = 1.875 GB up to 1.9)
        assert within(est.model_states_bytes, total, 0.015), (stage, est.model_states_bytes)


def test_deepspeed_reference_matches_its_documented_example():
    # DeepSpeed's docs: bigscience/T0_3B (2851 M params, 32 M largest layer), 1 node × 8 GPUs:
    # 15.93 GB per GPU for ZeRO-2 and 6.09 GB for ZeRO-3 without offload (GiB, as it prints).
    assert round(deepspeed_zero2_gpu_bytes(2851_000_000, 8) / GiB, 2) == 15.93
    assert round(deepspeed_zero3_gpu_bytes(2851_000_000, 32_000_000, 8) / GiB, 2) == 6.09


def test_deepspeed_reference_is_reported_for_zero3(capsys):
    out = run_json(
        capsys, "--preset", "llama-13b", "--zero", "3", "--gpus", "8", "--master-weights"
    )
    ref = out["reference"]["deepspeed_zero3_model_states_bytes"]
    # Ours partitions 16 B a parameter (no fp32 gradient copy) and counts the gathered layer
    # as overhead: below DeepSpeed's 18 B + 4 × largest layer, by about that difference.
    ours = out["model_states_bytes"] + out["details"]["zero3_gather_bytes"]
    assert ours < ref
    assert within(ours, ref, 0.12)


def test_activations_follow_korthikanti():
    arch = PRESETS["llama-7b"]
    s, b, h, a, L = 2048, 2, 4096, 32, 32
    eager = estimate(arch, Setup(batch=b, seq=s, attention="eager"))
    assert eager.details["activation_layers_bytes"] == L * s * b * h * (34 + 5 * a * s // h)
    sdpa = estimate(arch, Setup(batch=b, seq=s))
    assert sdpa.details["activation_layers_bytes"] == L * s * b * h * 34
    full = estimate(arch, Setup(batch=b, seq=s, checkpointing="full"))
    assert full.details["activation_layers_bytes"] == 2 * s * b * h * L + 34 * s * b * h
    assert full.activations_bytes < sdpa.activations_bytes < eager.activations_bytes


def test_max_batch_is_the_largest_that_fits():
    arch = PRESETS["llama-7b"]
    setup = Setup(lora_rank=16, quantize_base="4bit", seq=1024)
    capacity = 24 * GiB
    n = max_batch(arch, setup, capacity)
    assert n >= 1
    fits = estimate(arch, Setup(**{**_fields(setup), "batch": n}))
    over = estimate(arch, Setup(**{**_fields(setup), "batch": n + 1}))
    assert fits.total_bytes <= usable_bytes(capacity) < over.total_bytes


def _fields(setup: Setup) -> dict:
    return {name: getattr(setup, name) for name in Setup.__dataclass_fields__}


def test_optimizers_order_and_hf_config_of_llama(tmp_path):
    arch = PRESETS["llama-7b"]
    state = {
        name: estimate(arch, Setup(optimizer=name)).optimizer_state_bytes
        for name in ("adamw", "adamw-8bit", "sgd", "adafactor")
    }
    assert state["sgd"] == 0 < state["adafactor"] < state["adamw-8bit"] < state["adamw"]
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "hidden_act": "silu",
    }
    assert from_hf_config(config).parameter_count() == LLAMA_7B_PARAMS
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(tmp_path / "config.json").parameter_count() == LLAMA_7B_PARAMS


def test_text_table_and_bad_input(capsys, tmp_path):
    assert main(["estimate", "--params", "7B", "--gpu", "a100-40gb"]) == 0
    text = capsys.readouterr().out
    assert "shape assumed" in text and "a100-40gb" in text and "optimizer state" in text
    assert main(["estimate", "--params", "seven"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memtop: ") and err.count("\n") == 1
    assert main(["estimate", "--config", str(tmp_path / "nope.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["estimate", "--config", str(tmp_path / "bad.json")]) == 1
    assert "not JSON" in capsys.readouterr().err
    assert main(["estimate", "--preset", "gpt2", "--gpu", "tpu"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    # A capacity instead of a name: a MIG slice, a per-process memory fraction.
    out = run_json(capsys, "--preset", "gpt2", "--gpu", "8.5GB", "--gpu", "20GiB")
    assert [t["total_bytes"] for t in out["targets"]] == [8_500_000_000, 20 * GiB]
    assert (
        main(["estimate", "--preset", "llama-7b", "--lora-rank", "8", "--lora-targets", "x"]) == 2
    )
    assert "LoRA target" in capsys.readouterr().err


def test_estimate_does_not_import_torch():
    code = (
        "import sys, memtop.estimate.command, memtop.estimate.render; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- optimizer state against torch's own optimizers (issue 24, item 1) ---------------------------

TINY_LLAMA = Architecture("tiny-llama", "llama", 2, 64, 4, 512, 176, 2)
TINY_GPT = Architecture("tiny-gpt", "gpt", 2, 64, 4, 512, 256, 4, positions=128)


def _torch_model(arch: Architecture, dtype):
    """`arch` built from torch modules as the model families define them (not from memtop's
    tensor list), so the parameter count is checked too."""
    import torch
    from torch import nn

    h, inter = arch.hidden, arch.intermediate
    kv = arch.kv_heads * (h // arch.heads)

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

    def llama_block() -> nn.Module:
        block = nn.Module()
        block.q_proj, block.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False)
        block.v_proj, block.o_proj = nn.Linear(h, kv, bias=False), nn.Linear(h, h, bias=False)
        block.gate_proj = nn.Linear(h, inter, bias=False)
        block.up_proj = nn.Linear(h, inter, bias=False)
        block.down_proj = nn.Linear(inter, h, bias=False)
        block.input_layernorm, block.post_attention_layernorm = RMSNorm(), RMSNorm()
        return block

    def gpt_block() -> nn.Module:
        block = nn.Module()
        block.ln_1, block.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        block.c_attn, block.attn_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        block.c_fc, block.mlp_proj = nn.Linear(h, inter), nn.Linear(inter, h)
        return block

    model = nn.Module()
    model.embed = nn.Embedding(arch.vocab, h)
    if arch.family == "llama":
        model.blocks = nn.ModuleList(llama_block() for _ in range(arch.layers))
        model.norm = RMSNorm()
    else:
        model.positions = nn.Embedding(arch.positions, h)
        model.blocks = nn.ModuleList(gpt_block() for _ in range(arch.layers))
        model.norm = nn.LayerNorm(h)
    model.head = nn.Linear(h, arch.vocab, bias=False)
    return model.to(dtype)


def _state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors; `step` is a CPU scalar in torch (not GPU memory)."""
    import torch

    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    )


def _step(model_params, optimizer) -> None:
    import torch

    for p in model_params:
        p.grad = torch.randn_like(p)
    optimizer.step()


TORCH_OPTIMIZERS = {
    "adamw": lambda torch, ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam": lambda torch, ps: torch.optim.Adam(ps, lr=1e-3),
    "sgd": lambda torch, ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd-momentum": lambda torch, ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adafactor": lambda torch, ps: torch.optim.Adafactor(ps, lr=1e-3),
}


@pytest.mark.parametrize("arch", [TINY_LLAMA, TINY_GPT], ids=lambda a: a.name)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_optimizer_state_matches_torch(arch, dtype, name):
    torch = pytest.importorskip("torch")
    model = _torch_model(arch, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == arch.parameter_count()
    optimizer = TORCH_OPTIMIZERS[name](torch, params)
    _step(params, optimizer)
    est = estimate(arch, Setup(dtype=dtype, optimizer=name))
    assert est.optimizer_state_bytes == _state_bytes(optimizer), (name, dtype)


def test_master_weights_are_the_zero_papers_sixteen_bytes():
    """bf16 weights and gradients, an fp32 master copy stepped by AdamW (fp32 moments): 16 bytes
    a parameter of model states, the ZeRO paper's 2 + 2 + K with K = 12."""
    torch = pytest.importorskip("torch")
    model = _torch_model(TINY_LLAMA, torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(master, lr=1e-3)
    _step(master, optimizer)
    for p in params:
        p.grad = torch.zeros_like(p)
    measured = sum(
        t.numel() * t.element_size() for t in [*params, *(p.grad for p in params), *master]
    ) + _state_bytes(optimizer)
    est = estimate(TINY_LLAMA, Setup(dtype="bf16", master_weights=True))
    assert est.model_states_bytes == measured == 16 * TINY_LLAMA.parameter_count()
    assert est.optimizer_state_bytes == 12 * TINY_LLAMA.parameter_count()


def test_llama_7b_state_bytes_per_parameter(capsys):
    out = run_json(capsys, "--preset", "llama-7b", "--dtype", "bf16", "--optimizer", "adamw")
    p = out["parameters_count"]
    assert within(out["optimizer_state_bytes"], 4 * p, 0.01)  # bf16 moments, as torch keeps
    out = run_json(capsys, "--preset", "llama-7b", "--dtype", "bf16", "--master-weights")
    assert within(out["model_states_bytes"], 16 * p, 0.01)  # ZeRO's 2 + 2 + 12
    out = run_json(capsys, "--preset", "llama-7b", "--dtype", "fp32", "--optimizer", "adamw")
    assert within(out["optimizer_state_bytes"], 8 * p, 0.01)


def test_bitsandbytes_8bit_adam_by_its_layout():
    """bitsandbytes' Optimizer2State (optim/optimizer.py, init_state): for a tensor of at least
    min_8bit_size = 4096 values, state1 and state2 are uint8 and absmax1/absmax2 hold one fp32
    per 2048-value block; a smaller tensor keeps fp32 state1/state2; qmap1/qmap2 are shared."""
    one = Architecture("one-matrix", "llama", 1, 4096, 32, 32000, 11008, 32)
    est = estimate(one, Setup(optimizer="adamw-8bit"))
    expected = 0
    for shape, n in one.parameter_tensors():
        size = 1
        for d in shape:
            size *= d
        blocks = -(-size // 2048)
        expected += n * (2 * size + 8 * blocks if size >= 4096 else 8 * size)
    assert est.optimizer_state_bytes == expected
    # A 4096 × 4096 matrix: 2 bytes a value and 2 × 8192 absmax values; a 64-value vector: fp32.
    assert expected > 2 * one.parameter_count()
    assert within(expected, 2 * one.parameter_count(), 0.01)
    small = estimate(TINY_LLAMA, Setup(optimizer="adamw-8bit"))
    norms = 64 * (2 * TINY_LLAMA.layers + 1)  # under 4096 values each: 32-bit states
    assert small.optimizer_state_bytes > 8 * norms


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--params", "1e30"], "more than any model"),
        (["--params", "-7B"], "at least 1"),
        (["--params", "0"], "at least 1"),
        (["--preset", "gpt2", "--qlora", "--lora-rank", "0"], "--lora-rank 0"),
        (["--preset", "gpt2", "--lora-rank", "-4"], "--lora-rank -4"),
        (["--preset", "gpt2", "--gpu", "0GiB"], "at least 1 MiB"),
        (["--preset", "gpt2", "--gpu", "999999GiB"], "more memory than any GPU"),
        (["--preset", "gpt2", "--batch", "0"], "at least 1"),
    ],
)
def test_bad_values_are_one_line_usage_errors(capsys, args, says):
    """Issue 21 item 15: each a one-line error with exit code 2, never a figure or argparse's
    'expected one argument'."""
    assert main(["estimate", *args, "--gpu", "h100"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("memtop: ") and captured.err.count("\n") == 1
    assert says in captured.err


def test_sizes_read_one_unit_up_once_they_round_to_one():
    from memtop.figures.units import MiB, format_bytes

    assert format_bytes(1023.9 * MiB) == "1.0 GiB"
    assert format_bytes(1024 * MiB) == "1.0 GiB"
    assert format_bytes(972 * MiB) == "972.0 MiB"
    assert format_bytes(5 * 1024**5) == "5.0 PiB"


# -- ways to fit, QLoRA's 65B, DeepSpeed's figures explained (issue 24, items 2-5) ---------------

QLORA_65B = (
    "--preset", "llama-65b", "--qlora", "--lora-rank", "64", "--lora-targets", "all-linear",
    "--checkpointing", "full", "--batch", "1", "--seq", "512", "--gpu", "48GB",
)  # fmt: skip


def test_llama_65b_preset_has_the_published_count():
    # LLaMA-65B (Touvron et al. 2023, Table 2: 65.2 B; the HF config's exact count).
    assert within(PRESETS["llama-65b"].parameter_count(), 65.2e9, 0.002)


def test_qlora_65b_fits_48gb_as_in_the_qlora_paper(capsys):
    """Dettmers et al. 2023 (QLoRA), abstract: 'finetune a 65B parameter model on a single 48GB
    GPU', with LoRA r=64 on every linear layer, NF4 + double quantization, and paged 32-bit
    AdamW for the optimizer's spikes (§2 'Paged Optimizers'; qlora.py: paged_adamw_32bit)."""
    paper = run_json(capsys, *QLORA_65B, "--optimizer", "paged-adamw-32bit")
    assert paper["fits"] is True and paper["max_batch"] >= 1
    paged = paper["details"]["paged_optimizer_bytes"]
    assert paged == paper["optimizer_state_bytes"] == 8 * paper["trainable_parameters_count"]
    assert paper["targets"][0]["free_bytes"] == (
        paper["targets"][0]["usable_bytes"] - (paper["total_bytes"] - paged)
    )
    # The paper's script also keeps the adapters in bf16.
    bf16 = run_json(
        capsys, *QLORA_65B, "--optimizer", "paged-adamw-32bit", "--adapter-dtype", "bf16"
    )
    assert (
        bf16["fits"] is True and bf16["gradients_bytes"] == 2 * bf16["trainable_parameters_count"]
    )
    # Without paging, fp32 adapters, their gradients and Adam state do not fit: the estimate
    # then lists the ways that do.
    plain = run_json(capsys, *QLORA_65B)
    assert plain["fits"] is False
    assert {"--optimizer paged-adamw-8bit", "--offload-optimizer"} <= {
        w["change"] for w in plain["ways_to_fit"]
    }


def test_7b_full_fine_tune_lists_ways_to_fit_cheapest_first(capsys):
    out = run_json(
        capsys, "--preset", "llama-7b", "--dtype", "bf16", "--master-weights", "--gpu", "h100"
    )
    assert out["fits"] is False
    ways = out["ways_to_fit"]
    assert len(ways) >= 3
    usable = out["targets"][0]["usable_bytes"]
    for way in ways:
        assert way["fits"] is True and way["required_bytes"] <= usable
        assert way["total_bytes"] > 0 and way["cost"] and way["what"]
        # Each way's figure is the estimate of the setup with that change made.
        flags = way["change"].split(" (")[0].split()
        if way["change"].startswith("--"):
            again = run_json(
                capsys, "--preset", "llama-7b", "--master-weights", "--gpu", "h100", *flags
            )
            assert again["total_bytes"] == way["total_bytes"], way["change"]
    changes = [w["change"] for w in ways]
    assert changes.index("--optimizer adamw-8bit") < changes.index("--lora-rank 16")
    assert any(c.startswith("--zero 3 --gpus 2") for c in changes)
    # A batch that does not fit keeps its global batch by gradient accumulation first.
    big = run_json(capsys, "--preset", "llama-7b", "--batch", "8", "--gpu", "h100")
    assert big["fits"] is False
    assert big["ways_to_fit"][0]["change"].startswith("--batch 2 (× 4 accumulation steps)")
    # A setup with room to spare lists none.
    small = run_json(capsys, "--preset", "gpt2", "--gpu", "h100")
    assert small["fits"] is True and small["ways_to_fit"] == []


def test_text_explains_deepspeed_and_recomputation_without_json_keys(capsys):
    assert main(["estimate", "--preset", "llama-13b", "--zero", "2", "--gpus", "8",
                 "--checkpointing", "full", "--gpu", "h100"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "_bytes" not in text  # no raw JSON key
    assert "estimate_zero2_model_states_mem_needs" in text and "fixed recipe" in text
    assert "the table above counts this setup" in text
    assert "one layer's activations recomputed in the backward" in text
    assert main(["estimate", "--preset", "llama-7b", "--master-weights", "--gpu", "h100"]) == 0
    text = capsys.readouterr().out
    assert "Ways to fit in h100-80gb" in text and "--optimizer adamw-8bit" in text


# -- activations and the largest batch against the H100 recordings (issue 24, item 2) ------------


def _gpt_config(tmp_path: Path, layers: int) -> Path:
    """shared/gpu/train_gpt.py's model as a GPT-2 config.json (d=768, vocab 32000, no position
    table, an untied head)."""
    config = {
        "model_type": "gpt2", "n_embd": 768, "n_layer": layers, "n_head": 12,
        "vocab_size": 32000, "n_positions": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    path = tmp_path / f"gpt-{layers}" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def _recorded_peak(name: str) -> int:
    peak = 0
    with gzip.open(TRACES / f"{name}.jsonl.gz", "rt") as f:
        for line in f:
            result = (json.loads(line).get("reply") or {}).get("result") or {}
            for device in result.get("devices") or []:
                if isinstance(device, dict) and "stats" in device:
                    peak = max(peak, device["stats"]["allocated_bytes.all.peak"])
    return peak


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_peak_of_the_healthy_recording(capsys, tmp_path):
    """healthy: batch 8 × 512, fp32 + bf16 autocast, 12 layers.  torch's allocated peak is
    reached at the start of the backward, before any gradient exists (zero_grad sets them to
    None): the estimate's weights, optimizer state and activations, without the gradients and
    the CUDA context (outside torch's counters), are that peak."""
    out = run_json(
        capsys, "--config", str(_gpt_config(tmp_path, 12)), "--dtype", "fp32", "--autocast",
        "--batch", "8", "--seq", "512",
    )  # fmt: skip
    at_peak = out["weights_bytes"] + out["optimizer_state_bytes"] + out["activations_bytes"]
    assert within(at_peak, _recorded_peak("healthy"), 0.01)


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_largest_batch_of_the_oom_trainer(capsys, tmp_path):
    """oom: 4 layers, fp32 + bf16 autocast, seq 512, an 8.5 GB cap (fraction 0.1 of the H100's
    85.0 GB): batch 18 ran (with one allocator retry) and 23 failed, every time (README of
    shared/traces).  The logits of the 32 k vocabulary are most of each sample's bytes."""
    out = run_json(
        capsys, "--config", str(_gpt_config(tmp_path, 4)), "--dtype", "fp32", "--autocast",
        "--seq", "512", "--gpu", "8.5GB",
    )  # fmt: skip
    assert 18 <= out["max_batch"] <= 22
    assert out["details"]["logits_bytes"] > out["details"]["activation_layers_bytes"]


# -- calibrated by the run itself: --from RECORDING (issue 24, "What to build" 3) ---------------


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_the_oom_recording_predicts_its_boundary(capsys):
    """oom: the recorded run's largest step was batch 18 (it ran, with one allocator retry) and
    batch 23 failed 377 times.  Fitted to batch 18's peak (6.51 GB allocated, 7.80 GB
    reserved), weights and optimizer state, the first failing batch in its 8.5 GB cap must be
    within one of that boundary (19 to 23 were never tried: the truth lies in 19..23)."""
    out = run_json(
        capsys, "--from", str(TRACES / "oom.jsonl.gz"), "--measured-batch", "18",
        "--batch", "23", "--gpu", "8.5GB",
    )  # fmt: skip
    cal = out["calibration"]
    assert cal["measured"]["peak_bytes"] == 6_509_511_680
    assert cal["fixed_bytes"] == 310_141_952 + 620_283_904  # parameters + AdamW state
    assert out["max_batch"] == 18 and cal["first_failing_batch"] == 19
    assert out["fits"] is False  # batch 23 does not fit
    assert out["total_bytes"] == sum(
        out[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_state_bytes",
                         "activations_bytes", "overhead_bytes")
    )  # fmt: skip


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_the_healthy_recording_reproduces_its_peak(capsys):
    out = run_json(capsys, "--from", str(TRACES / "healthy.jsonl.gz"), "--measured-batch", "8")
    measured = _recorded_peak("healthy")
    assert within(out["calibration"]["peak_bytes"], measured, 0.02)
    # At twice the batch, the activations (not the weights and the AdamW state) double.
    double = run_json(
        capsys, "--from", str(TRACES / "healthy.jsonl.gz"), "--measured-batch", "8", "--batch", "16"
    )
    fixed = out["calibration"]["fixed_bytes"]
    assert double["calibration"]["peak_bytes"] - fixed == pytest.approx(
        2 * (out["calibration"]["peak_bytes"] - fixed), abs=2
    )


def test_from_needs_the_measured_batch_and_a_readable_recording(capsys, tmp_path):
    assert (
        main(["estimate", "--from", str(tmp_path / "nope.jsonl.gz"), "--measured-batch", "8"]) == 1
    )
    assert "no such file" in capsys.readouterr().err
    assert main(["estimate", "--from", str(tmp_path / "x.jsonl.gz")]) == 2
    assert "--measured-batch" in capsys.readouterr().err
    assert main(["estimate"]) == 2
    assert "--preset, --config, --params or --from" in capsys.readouterr().err


def test_from_a_live_agent_reads_its_peak_and_breakdown(capsys, socket_dir, monkeypatch):
    """`--from PID`: the agent's sample (torch's peak, reserved) and breakdown (weights,
    optimizer state), asked over its socket as `memtop cleanup` asks, fitted like a recording.
    A simulated allocator stands in for CUDA: weights 256 MiB, optimizer state 512 MiB, and
    each step 1 GiB of activations at 'batch 4'."""
    import threading

    from memtop.agent.probe import Breakdown, ProbeDevice
    from memtop.agent.server import Agent
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.probe import SimulatedGpu, SimulatedProbe

    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(socket_dir))
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(16 * GiB), 0)
    states = [allocator.malloc(256 * 2**20), allocator.malloc(512 * 2**20)]
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000002", "Sim GPU", 16 * GiB)
    breakdown = {0: Breakdown(256 * 2**20, 0, 512 * 2**20, 768 * 2**20)}
    probe = SimulatedProbe([SimulatedGpu(device, allocator)], breakdown=lambda: breakdown)
    agent = Agent(probe, socket_dir, argv=["train.py"])
    agent.start()
    stop = threading.Event()

    def train() -> None:  # the trainer's thread: a step of 1 GiB of activations
        while not stop.is_set():
            block = allocator.malloc(GiB)
            allocator.free(block)
            agent.on_step(explicit=True)
            stop.wait(0.02)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        import os

        out = run_json(capsys, "--from", str(os.getpid()), "--measured-batch", "4", "--batch", "8",
                       "--gpu", "16GiB")  # fmt: skip
    finally:
        stop.set()
        trainer.join(10)
        agent.stop()
        for block in states:
            allocator.free(block)
    cal = out["calibration"]
    assert cal["fixed_bytes"] == 768 * 2**20
    assert cal["measured"]["peak_bytes"] == 768 * 2**20 + GiB
    assert cal["activation_bytes_per_sample"] == GiB // 4
    assert cal["peak_bytes"] == 768 * 2**20 + 2 * GiB  # batch 8: twice the activations
    assert main(["estimate", "--from", "999999999", "--measured-batch", "4"]) == 1
    assert capsys.readouterr().err.startswith("memtop: ")


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_scales_by_tokens_when_the_sequence_changes(capsys):
    """healthy ran batch 8 × 512 tokens: batch 4 × 1024 holds as many tokens (the same
    activations with fused attention), batch 8 × 1024 twice as many."""
    base = ("--from", str(TRACES / "healthy.jsonl.gz"), "--measured-batch", "8")
    same = run_json(capsys, *base, "--measured-seq", "512", "--batch", "4", "--seq", "1024")
    measured = run_json(capsys, *base)
    assert same["calibration"]["peak_bytes"] == pytest.approx(
        measured["calibration"]["peak_bytes"], abs=2
    )
    longer = run_json(capsys, *base, "--measured-seq", "512", "--batch", "8", "--seq", "1024")
    fixed = measured["calibration"]["fixed_bytes"]
    assert longer["calibration"]["peak_bytes"] - fixed == pytest.approx(
        2 * (measured["calibration"]["peak_bytes"] - fixed), abs=4
    )
    per_token = longer["calibration"]["activation_bytes_per_token"]
    assert per_token == round((measured["calibration"]["peak_bytes"] - fixed) / (8 * 512))
    # The largest batch at 1024 tokens is about half the one at 512.
    at_512 = run_json(capsys, *base, "--measured-seq", "512", "--seq", "512", "--gpu", "h100")
    at_1024 = run_json(capsys, *base, "--measured-seq", "512", "--seq", "1024", "--gpu", "h100")
    assert abs(at_1024["max_batch"] - at_512["max_batch"] // 2) <= 1


# -- mixtures of experts (issue 32, item 1) ------------------------------------------------------


def _config_file(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_moe_counts_match_the_published_ones(capsys, tmp_path):
    """Within 1 % of each model's own published total and active counts (sources beside the
    configs in tests/moe_configs.py)."""
    from moe_configs import (
        DEEPSEEK_V2,
        DEEPSEEK_V3,
        GPT_OSS_120B,
        MIXTRAL_8X7B,
        OLMOE_1B_7B,
        QWEN3_30B_A3B,
        QWEN15_MOE_A27B,
    )

    def counts(config: dict) -> dict:
        return run_json(capsys, "--config", str(_config_file(tmp_path, "m", config)))

    mixtral = counts(MIXTRAL_8X7B)
    assert within(mixtral["parameters_count"], 46.7e9, 0.01)
    assert within(mixtral["active_parameters_count"], 12.9e9, 0.01)
    assert mixtral["experts"]["routed"] == 8 and mixtral["experts"]["per_token"] == 2
    qwen = counts(QWEN15_MOE_A27B)
    assert within(qwen["parameters_count"], 14.3e9, 0.01)
    assert within(qwen["active_parameters_count"], 2.7e9, 0.01)
    deepseek = counts(DEEPSEEK_V3)
    assert within(deepseek["parameters_count"], 671e9, 0.01)
    # DeepSeek counts active parameters without the input embedding table (0.9 B).
    assert within(deepseek["experts"]["active_without_input_embedding"], 36.6e9, 0.01)
    assert deepseek["experts"]["dense_layers"] == 3 and deepseek["experts"]["moe_layers"] == 58
    # The MTP module: 11.5 B of its own; with it the hub's 685 B.
    assert within(deepseek["mtp_parameters_count"], 11.5e9, 0.01)
    with_mtp = deepseek["parameters_count"] + deepseek["mtp_parameters_count"]
    assert within(with_mtp + 2 * 129280 * 7168, 685e9, 0.01)  # + its copies of embed and head
    oss = counts(GPT_OSS_120B)
    assert within(oss["parameters_count"], 116.83e9, 0.001)  # the card's figure, 5 digits
    assert within(oss["experts"]["active_without_input_embedding"], 5.13e9, 0.001)
    qwen3 = counts(QWEN3_30B_A3B)
    assert within(qwen3["parameters_count"], 30.5e9, 0.01)
    assert within(qwen3["active_parameters_count"], 3.3e9, 0.02)  # 3.35 B: "3.3B" rounds it
    deepseek2 = counts(DEEPSEEK_V2)
    assert within(deepseek2["parameters_count"], 236e9, 0.01)
    assert within(deepseek2["experts"]["active_without_input_embedding"], 21e9, 0.01)
    olmoe = counts(OLMOE_1B_7B)
    assert within(olmoe["parameters_count"], 6.9e9, 0.01)
    assert within(olmoe["active_parameters_count"], 1.3e9, 0.02)  # 1.28 B: "1.3B" rounds it


def test_mixtral_is_not_one_dense_expert(capsys, tmp_path):
    """873fb27 counted Mixtral-8x7B as 7.242 B parameters and fit it in an H100 with 9.8 GiB to
    spare; its bf16 weights alone are ~87 GiB."""
    from moe_configs import MIXTRAL_8X7B

    path = _config_file(tmp_path, "mixtral", MIXTRAL_8X7B)
    out = run_json(capsys, "--config", str(path), "--gpu", "h100-80gb")
    assert within(out["weights_bytes"], 87 * GiB, 0.01)
    assert out["fits"] is False
    # Gradients and Adam's moments over every expert, not only the active ones.
    assert out["gradients_bytes"] == out["weights_bytes"]
    assert main(["estimate", "--config", str(path), "--gpu", "h100-80gb"]) == 0
    text = capsys.readouterr().out
    assert "46.703 B parameters (12.880 B active per token: 2 of 8 experts in 32 layers)" in text
    # Expert parallelism: each of 8 GPUs holds one expert of each layer.
    ep = run_json(capsys, "--config", str(path), "--ep", "8", "--gpus", "8")
    arch = load_hf_config(path)
    routed = arch.moe_layers * arch.experts * arch.expert_params()
    expected = 2 * (arch.parameter_count() - routed * 7 / 8)
    assert ep["weights_bytes"] == pytest.approx(expected, rel=1e-6)
    assert main(["estimate", "--config", str(path), "--ep", "3", "--gpus", "3"]) == 2
    assert "does not divide the 8 experts" in capsys.readouterr().err
    # Activations follow the top-k experts a token runs through, more with a capacity factor
    # (every expert's buffer sized for 1.25 × its share), none of it in the model states.
    dropless = run_json(capsys, "--config", str(path), "--batch", "4")
    padded = run_json(capsys, "--config", str(path), "--batch", "4", "--capacity-factor", "1.25")
    assert padded["activations_bytes"] > dropless["activations_bytes"]
    assert padded["weights_bytes"] == dropless["weights_bytes"]
    assert main(["estimate", "--preset", "llama-7b", "--capacity-factor", "1.25"]) == 2


def test_every_key_of_the_published_configs_is_read_or_known_harmless(tmp_path):
    """A test feeds every key of the published configs: each is read or known to change
    nothing counted (none is refused); a size key nobody reads is refused by name."""
    from moe_configs import PUBLISHED

    from memtop.estimate.architecture import UnreadConfigKey
    from memtop.estimate.config_keys import HARMLESS, READ

    for name, config in PUBLISHED.items():
        for key in config:
            assert key in READ or key in HARMLESS, (name, key)
        from_hf_config(config, name)  # refuses nothing
    # Keys a config could add that would change the size: each refused, named, in one line.
    base = PUBLISHED["mixtral-8x7b"]
    for key, value in (
        ("shared_intermediate_size", 1024),  # Granite MoE's shared experts
        ("num_vision_layers", 2),
        ("vision_config", {"hidden_size": 1024}),
        ("moe_num_experts", 16),
        ("expert_hidden_size", 512),
    ):
        with pytest.raises(UnreadConfigKey, match=repr(key)):
            from_hf_config({**base, key: value})
    # A mixture of experts of a family memtop has not checked is refused, not guessed.
    with pytest.raises(UnreadConfigKey, match="has not checked"):
        from_hf_config({**base, "model_type": "phimoe"})


def test_an_unread_size_key_is_a_one_line_refusal_exit_2(capsys, tmp_path):
    from moe_configs import MIXTRAL_8X7B

    path = _config_file(tmp_path, "x", {**MIXTRAL_8X7B, "n_shared_experts": 2, "model_type": "x"})
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'x'" in err and "has not checked" in err
    path = _config_file(tmp_path, "y", {**MIXTRAL_8X7B, "audio_config": {"layers": 4}})
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'audio_config'" in err and "refusing" in err
    # The dense configs the suite already reads still are: Llama's and GPT-2's full files.
    llama = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
        "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.31.0",
        "use_cache": True, "vocab_size": 32000,
    }  # fmt: skip
    assert from_hf_config(llama).parameter_count() == LLAMA_7B_PARAMS
    gpt2 = {
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
        "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
        "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12,
        "n_positions": 1024, "reorder_and_upcast_attn": False, "resid_pdrop": 0.1,
        "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
        "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
        "summary_type": "cls_index", "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "use_cache": True, "vocab_size": 50257,
    }  # fmt: skip
    assert from_hf_config(gpt2).parameter_count() == PRESETS["gpt2"].parameter_count()


def test_lora_on_a_mixture_of_experts_targets_attention_only(capsys, tmp_path):
    from moe_configs import MIXTRAL_8X7B

    path = _config_file(tmp_path, "m", MIXTRAL_8X7B)
    out = run_json(capsys, "--config", str(path), "--qlora")
    arch = load_hf_config(path)
    assert out["trainable_parameters_count"] == arch.lora_params(16, ("q_proj", "v_proj"))
    assert main(["estimate", "--config", str(path), "--lora-rank", "8",
                 "--lora-targets", "all-linear"]) == 2  # fmt: skip
    assert "experts' matrices" in capsys.readouterr().err


# -- serving (issue 32, item 2) ------------------------------------------------------------------


def test_serving_llama_70b_in_4bit_on_24gb(capsys):
    """The issue's question: will a 70B in 4-bit fit a 24 GB GPU for generation at 8k context?
    No: its 4-bit weights alone are ~34 GiB; two GPUs with --tp, or layers offloaded to CPU
    memory (with their cost per token), would."""
    args = ("--serve", "--preset", "llama-70b", "--quantize", "4bit", "--seq", "8192",
            "--gpu", "24GiB")  # fmt: skip
    out = run_json(capsys, *args)
    assert out["mode"] == "serve" and out["fits"] is False
    assert within(out["weights_bytes"], 34 * GiB, 0.01)
    assert out["kv_bytes_per_token"] == 320 * 1024  # 2 × 80 × 8 × 128 × 2 bytes
    assert out["kv_cache_bytes"] == 320 * 1024 * 8192
    assert out["max_concurrency"] == 0 and out["max_context"] == 0
    changes = [way["change"] for way in out["ways_to_fit"]]
    assert "--tp 2" in changes and any(c.startswith("--offload-layers") for c in changes)
    assert all(way["fits"] for way in out["ways_to_fit"])
    assert main(["estimate", *args]) == 0
    text = capsys.readouterr().out
    assert "does not fit" in text and "the weights alone are 33.9 GiB" in text
    assert "s a token at 25 GB/s" in text and "4-bit NF4" in text
    # What --tp 2 says, checked by running it.
    two = run_json(capsys, *args, "--tp", "2")
    assert two["fits"] is True and two["weights_bytes"] == pytest.approx(
        out["weights_bytes"] / 2, abs=1
    )


def test_kv_cache_per_token_by_attention_kind(capsys, tmp_path):
    from moe_configs import DEEPSEEK_V3, GPT_OSS_120B

    # Llama-2-70B (GQA, 8 KV heads): 320 KiB in fp16; 160 KiB in fp8.
    out = run_json(capsys, "--serve", "--preset", "llama-70b", "--kv-dtype", "fp16")
    assert out["kv_bytes_per_token"] == 327_680
    out = run_json(capsys, "--serve", "--preset", "llama-70b", "--kv-dtype", "fp8")
    assert out["kv_bytes_per_token"] == 163_840
    # LLaMA-7B (MHA): 2 × 32 × 32 × 128 × 2 = 512 KiB.
    assert run_json(capsys, "--serve", "--preset", "llama-7b")["kv_bytes_per_token"] == 524_288
    # DeepSeek-V3's latent attention: (512 + 64) × 61 layers × 2 bytes, whatever --tp.
    path = _config_file(tmp_path, "ds", DEEPSEEK_V3)
    for tp in ("1", "8"):
        out = run_json(capsys, "--serve", "--config", str(path), "--tp", tp)
        assert out["kv_bytes_per_token"] == 576 * 61 * 2
    # gpt-oss: half its layers keep at most a 128-token window.
    path = _config_file(tmp_path, "oss", GPT_OSS_120B)
    out = run_json(capsys, "--serve", "--config", str(path), "--seq", "8192")
    per_layer = 2 * 8 * 64 * 2
    assert out["kv_cache_bytes"] == per_layer * (18 * 8192 + 18 * 128)
    # Its checkpoint's MXFP4 experts and bf16 rest: ~60.8 GiB (the published checkpoint).
    assert within(out["weights_bytes"], 60.8 * GiB, 0.01)
    assert "MXFP4" in out["recipe"]


def test_serving_limits_and_the_vllm_budget(capsys):
    out = run_json(capsys, "--serve", "--preset", "llama3-8b", "--seq", "8192", "--gpu", "h100",
                   "--gpu-memory-utilization", "0.9", "--concurrency", "4")  # fmt: skip
    check = out["targets"][0]
    usable, fixed = check["usable_bytes"], out["total_bytes"] - out["kv_cache_bytes"]
    per_sequence = out["kv_bytes_per_token"] * 8192
    n = out["max_concurrency"]
    assert fixed + n * per_sequence <= usable < fixed + (n + 1) * per_sequence
    longest = out["max_context"]
    per_token = out["kv_bytes_per_token"] * 4
    assert fixed + longest * per_token <= usable < fixed + (longest + 1) * per_token
    vllm = check["vllm"]
    assert vllm["kv_cache_bytes"] == int(check["total_bytes"] * 0.9) - fixed
    assert vllm["max_concurrency"] == round(vllm["kv_cache_tokens"] / 8192, 2)


def test_serving_refuses_training_flags_and_quantize_base_alone_points_to_it(capsys):
    assert main(["estimate", "--serve", "--preset", "llama-7b", "--optimizer", "sgd"]) == 2
    assert "training setting" in capsys.readouterr().err
    assert main(["estimate", "--preset", "llama-70b", "--quantize-base", "4bit"]) == 2
    assert "--serve --quantize" in capsys.readouterr().err
    assert main(["estimate", "--serve", "--params", "7B"]) == 2
    assert "attention shape" in capsys.readouterr().err
    assert main(["estimate", "--preset", "llama-7b", "--kv-dtype", "fp8"]) == 2
    assert "serving setting: add --serve" in capsys.readouterr().err


# -- the recipe said (issue 32, item 3) ------------------------------------------------------


def test_the_recipe_is_named_and_the_common_one_costed(capsys):
    """873fb27 said llama3-8b 'fits, 1.0 GiB to spare' on an H100 without saying it counted pure
    bf16 training; the common recipe (HF bf16=True: fp32 weights under bf16 autocast) needs
    134-151 GiB, and --autocast alone was an error."""
    assert main(["estimate", "--preset", "llama3-8b", "--gpu", "h100-80gb"]) == 0
    text = capsys.readouterr().out
    assert "recipe: pure bf16: bf16 weights, gradients and Adam moments, no fp32 master" in text
    assert "would need 151.5 GiB: add --autocast" in text
    pure = run_json(capsys, "--preset", "llama3-8b")
    assert pure["recipe"].startswith("pure bf16")
    mixed = run_json(capsys, "--preset", "llama3-8b", "--autocast")
    assert mixed["setup"]["dtype"] == "fp32" and mixed["recipe"].startswith("mixed precision")
    assert pure["mixed_precision"]["total_bytes"] == mixed["total_bytes"]
    assert 134 * GiB <= mixed["total_bytes"] <= 152 * GiB and mixed["mixed_precision"] is None
    master = run_json(capsys, "--preset", "llama3-8b", "--master-weights")
    assert "master" in master["recipe"]
    assert main(["estimate", "--preset", "llama3-8b", "--dtype", "bf16", "--autocast"]) == 2
    assert "--master-weights" in capsys.readouterr().err
    # The overhead row, split: the allocator's reserve is its own row and field.
    long = run_json(capsys, "--preset", "llama3-8b", "--seq", "8192")
    assert long["context_bytes"] + long["allocator_reserve_bytes"] == long["overhead_bytes"]
    assert long["allocator_reserve_bytes"] == long["details"]["allocator_cache_bytes"] > 8e9
    assert main(["estimate", "--preset", "llama3-8b", "--seq", "8192"]) == 0
    text = capsys.readouterr().out
    assert "allocator reserve" in text and "CUDA context etc." not in text


# -- GPUs: free now, AMD, MIG (issue 32 item 4, issue 31 item 1) ---------------------------------


def test_mig_profiles_and_amd_presets_by_name(capsys):
    out = run_json(capsys, "--preset", "gpt2", "--gpu", "a100-80gb:3g.40gb",
                   "--gpu", "h100-80gb:1g.10gb", "--gpu", "mi300x")  # fmt: skip
    a100, h100, mi300x = out["targets"]
    assert a100["total_bytes"] == 81_920 * 2**20 // 2  # 4 of the board's 8 memory slices
    assert a100["name"] == "a100-80gb MIG 3g.40gb"
    assert h100["total_bytes"] == 85_017_493_504 // 8
    assert mi300x["total_bytes"] == 192 * GiB
    assert main(["estimate", "--preset", "gpt2", "--gpu", "a100-80gb:3g.20gb"]) == 2
    assert "not a MIG profile of a100-80gb" in capsys.readouterr().err


@pytest.fixture(scope="module")
def rocm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from amd_standin import build

    return build(tmp_path_factory.mktemp("rocm"))


def test_this_machines_amd_gpus_fit_what_is_free_now(rocm, tmp_path, socket_dir):
    """The pre-load check compares with what is free now, and sees AMD GPUs through amdsmi as
    NVIDIA ones through NVML (873fb27: NVML only, total memory).  The real `amdsmi` package
    over the stand-in libamd_smi.so, in a child process (it binds its library once)."""
    import os
    import subprocess
    import sys

    from amd_standin import STATE_ENV, Gpu, State

    busy, idle = Gpu(used=170 * GiB, bdf="0000:0c:00.0"), Gpu(used=2 * GiB, bdf="0000:22:00.0")
    state = State(gpus=[busy, idle]).write(tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if k not in ("ROCM_HOME", STATE_ENV)}
    env.update(ROCM_PATH=str(rocm), MEMTOP_SOCKET_DIR=str(socket_dir), **{STATE_ENV: str(state)})
    # As root, amdsmi's library loads only where /dev/kfd is: the stand-in's is in the test's dir.
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").touch()
    env["MEMTOP_TEST_DEV_DIR"] = str(tmp_path / "dev")
    done = subprocess.run(
        [sys.executable, "-m", "memtop", "estimate", "--preset", "llama-7b", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    first, second = out["targets"]
    assert first["source"] == second["source"] == "amdsmi"
    assert first["total_bytes"] == 192 * GiB and first["free_now_bytes"] == 22 * GiB
    # 7B pure bf16 (~60 GiB) fits the idle GPU's 190 GiB free, not the busy one's 22 GiB.
    assert first["fits"] is False and second["fits"] is True
    assert first["usable_bytes"] == pytest.approx(22 * GiB, rel=1e-6)
    text = subprocess.run(
        [sys.executable, "-m", "memtop", "estimate", "--preset", "llama-7b"],
        env=env, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "22.0 GiB free now of 192.0 GiB" in text


# -- --from that knows what it fitted (issue 32 item 5, issue 36 item 9) ---------------------


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_a_leaking_recording_is_refused(capsys):
    """873fb27 fitted the leak recording's growth as activations (1.9 GiB 'a sample', largest
    batch 35); its baseline grows 12 MiB a step, which memtop's leak verdict sees."""
    assert main(["estimate", "--from", str(TRACES / "leak.jsonl.gz"), "--measured-batch", "8",
                 "--gpu", "h100"]) == 1  # fmt: skip
    captured = capsys.readouterr()
    assert "largest batch" not in captured.out
    err = captured.err
    assert err.count("\n") == 1 and "leak verdict" in err and "pid 427" in err
    healthy = run_json(capsys, "--from", str(TRACES / "healthy.jsonl.gz"), "--measured-batch", "8")
    measured = healthy["calibration"]["measured"]
    assert measured["leak"].startswith("no leak")
    assert (measured["first_step"], measured["last_step"]) == (1, measured["steps"])


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_a_recording_of_several_trainers_asks_which(capsys):
    """The folder of six H100 recordings: 873fb27 silently took the largest peak (the leaking
    trainer's); now the user chooses with --pid, and the output says which it used."""
    assert main(["estimate", "--from", str(TRACES), "--measured-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "6 trainers" in err and "--pid" in err and "426" in err and "434" in err
    out = run_json(capsys, "--from", str(TRACES), "--measured-batch", "8", "--pid", "426")
    alone = run_json(capsys, "--from", str(TRACES / "healthy.jsonl.gz"), "--measured-batch", "8")
    assert out["calibration"]["measured"]["pid"] == 426
    assert out["calibration"]["peak_bytes"] == alone["calibration"]["peak_bytes"]
    assert main(["estimate", "--from", str(TRACES), "--measured-batch", "8", "--pid", "426"]) == 0
    assert "(pid 426, GPU 0, steps 1-" in capsys.readouterr().out
    assert main(["estimate", "--from", str(TRACES), "--measured-batch", "8", "--pid", "7"]) == 2
    assert "no trainer of that pid" in capsys.readouterr().err


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_reads_the_recording_once(capsys, tmp_path, replay_parses):
    """`--from` read the recording twice, once for its trainers and once for the chosen one,
    and held every event of the first reading in a list (30 MB for the 0.9 MB of gzip of the
    six traces)."""
    import shutil

    import memtop.sources.replay as replay

    two = tmp_path / "two"  # two trainers: pids 426 and 434
    two.mkdir()
    for name in ("healthy.jsonl.gz", "hf-trainer.jsonl.gz"):
        shutil.copy(TRACES / name, two / name)
    parsed = replay_parses
    assert replay.load(two / "hf-trainer.jsonl.gz").events  # pid 434's own recording
    own, parsed[0] = parsed[0], 0
    assert replay.load(two).events  # one whole reading
    once, parsed[0] = parsed[0], 0
    # --pid: the chosen trainer's recording alone (a folder of six parsed all six for one),
    # and the other's hello, read at load for its pid.
    out = run_json(capsys, "--from", str(two), "--measured-batch", "8", "--pid", "434")
    assert out["calibration"]["measured"]["pid"] == 434
    assert parsed[0] == own + 1 < once, f"{parsed[0]} parses for its {own} lines of {once}"
    parsed[0] = 0
    assert main(["estimate", "--from", str(two), "--measured-batch", "8"]) == 2
    assert "2 trainers" in capsys.readouterr().err
    assert parsed[0] == once, f"{parsed[0]} parses for {once} lines"


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared/traces not present")
def test_from_a_number_is_a_pid_and_a_file_is_dot_slash(capsys, tmp_path, monkeypatch, socket_dir):
    """873fb27 read a file named 22035 in the current directory for `--from 22035`."""
    import shutil

    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(socket_dir))
    monkeypatch.chdir(tmp_path)
    shutil.copy(TRACES / "healthy.jsonl.gz", tmp_path / "999999999")
    assert main(["estimate", "--from", "999999999", "--measured-batch", "8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "say ./999999999" in err
    out = run_json(capsys, "--from", "./999999999", "--measured-batch", "8")
    assert out["calibration"]["measured"]["pid"] == 426


def test_readme_shows_what_the_estimate_prints(capsys):
    """README's estimate section: its training and serving examples are the commands' output
    (the lines before its "…")."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    examples = {
        "llama-7b: 6.738 B": ("--preset", "llama-7b", "--dtype", "bf16", "--master-weights",
                              "--gpu", "h100-80gb"),
        "llama-70b: 68.977 B": ("--serve", "--preset", "llama-70b", "--quantize", "4bit",
                                "--seq", "8192", "--gpu", "24GiB"),
    }  # fmt: skip
    for first, args in examples.items():
        command = "memtop estimate " + " ".join(args)
        assert command in readme, command
        block = readme[readme.index("```\n" + first) + 4 :]
        shown = block[: block.index("```")].splitlines()
        shown = shown[: shown.index("  …")] if "  …" in shown else shown
        assert main(["estimate", *args]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed[: len(shown)] == shown


def test_from_a_live_leaking_agent_is_refused(capsys, socket_dir, monkeypatch):
    """`--from PID` of a trainer whose baseline grows 8 MiB a step: 873fb27 fitted the leak as
    activations; memtop's own leak verdict on the agent's step marks refuses it."""
    import os
    import threading

    from memtop.agent.probe import Breakdown, ProbeDevice
    from memtop.agent.server import Agent
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.probe import SimulatedGpu, SimulatedProbe

    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(socket_dir))
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(64 * GiB), 0)
    states = [allocator.malloc(256 * 2**20)]
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000003", "Sim GPU", 64 * GiB)
    breakdown = {0: Breakdown(256 * 2**20, 0, 0, 256 * 2**20)}
    probe = SimulatedProbe([SimulatedGpu(device, allocator)], breakdown=lambda: breakdown)
    agent = Agent(probe, socket_dir, argv=["train.py"])
    agent.start()
    stop, stepped = threading.Event(), threading.Event()
    kept = []

    def train() -> None:  # each step: 64 MiB of activations, and 8 MiB kept for good
        steps = 0
        while not stop.is_set():
            block = allocator.malloc(64 * 2**20)
            kept.append(allocator.malloc(8 * 2**20))
            allocator.free(block)
            agent.on_step(explicit=True)
            steps += 1
            if steps >= 240:
                stepped.set()
            stop.wait(0.01)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        assert stepped.wait(60)
        code = main(["estimate", "--from", str(os.getpid()), "--measured-batch", "4"])
    finally:
        stop.set()
        trainer.join(10)
        agent.stop()
        for block in states + kept:
            allocator.free(block)
    captured = capsys.readouterr()
    assert code == 1 and "largest batch" not in captured.out, captured.out
    assert "leak verdict" in captured.err and "8.0 MiB a step" in captured.err
