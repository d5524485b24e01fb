"""`memtop estimate` against published numbers and memtop's own measurements on an H100."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.estimate import PRESETS, Setup, assumed_shape, estimate, max_batch
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
    assert within(out["optimizer_state_bytes"], 8 * p, 0.02)
    # The seeds' table: 14 GB of bf16 weights, 56 GB of AdamW state for "7B".
    assert within(out["weights_bytes"], 14e9, 0.05)
    assert within(out["optimizer_state_bytes"], 56e9, 0.05)
    parts = ("weights", "gradients", "optimizer_state", "activations", "overhead")
    assert out["total_bytes"] == sum(out[f"{k}_bytes"] for k in parts)
    # 7B full fine-tuning with AdamW does not fit an 80 GB GPU even at batch 1.
    assert out["fits"] is False and out["max_batch"] == 0
    assert out["targets"][0]["name"] == "h100-80gb"


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
    assert main(["estimate", "--params", "seven"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memtop: ") and err.count("\n") == 1
    assert main(["estimate", "--config", str(tmp_path / "nope.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["estimate", "--config", str(tmp_path / "bad.json")]) == 1
    assert "not JSON" in capsys.readouterr().err
    assert main(["estimate", "--preset", "gpt2", "--gpu", "tpu"]) == 1
    assert "unknown GPU" in capsys.readouterr().err
    # A capacity instead of a name: a MIG slice, a per-process memory fraction.
    out = run_json(capsys, "--preset", "gpt2", "--gpu", "8.5GB", "--gpu", "20GiB")
    assert [t["total_bytes"] for t in out["targets"]] == [8_500_000_000, 20 * GiB]
    assert (
        main(["estimate", "--preset", "llama-7b", "--lora-rank", "8", "--lora-targets", "x"]) == 1
    )
    assert "LoRA target" in capsys.readouterr().err


def test_estimate_does_not_import_torch():
    code = (
        "import sys, memtop.estimate.command, memtop.estimate.render; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
