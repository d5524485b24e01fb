"""`memtop estimate` against published numbers and memtop's own measurements on an H100."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.estimate import PRESETS, Architecture, Setup, assumed_shape, estimate, max_batch
from memtop.estimate.architecture import from_hf_config, load_hf_config
from memtop.estimate.memory import usable_bytes
from memtop.estimate.reference import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from memtop.units import GiB

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
    from memtop.units import MiB, format_bytes

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
