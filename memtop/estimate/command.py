"""`memtop estimate`: its arguments and what it prints.  The arithmetic is in memory.py; this
module only turns arguments into a Setup, finds the GPUs to fit in and prints."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from memtop.errors import MemtopError
from memtop.estimate.architecture import (
    PRESETS,
    Architecture,
    ArchitectureError,
    assumed_shape,
    load_hf_config,
    parse_count,
)
from memtop.estimate.gpus import NAMED_GPUS, parse_gpu
from memtop.estimate.memory import (
    ATTENTION,
    CHECKPOINTING,
    DTYPE_BYTES,
    OPTIMIZERS,
    Setup,
    estimate,
)
from memtop.estimate.render import Target, calibrated_json, calibrated_text, to_json, to_text


class EstimateError(MemtopError):
    """One line for the user (exit code 1)."""


class EstimateUsageError(EstimateError):
    """A flag's value that cannot be used: one line for the user (exit code 2, as argparse's
    own usage errors)."""

    exit_code = 2


# argparse takes "-7B" for an option ("expected one argument"): only "-7" and "-.5" look like
# numbers to it.  None of estimate's options starts with a digit, so anything "-<digit>..." is
# a value, and --params says why a negative count is wrong.
NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser._negative_number_matcher = NEGATIVE_VALUE  # type: ignore[attr-defined]
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted(PRESETS), help="a known architecture")
    model.add_argument("--config", type=Path, help="a local Hugging Face config.json (or its dir)")
    model.add_argument("--params", help="a parameter count (7e9, 7B, 134M); the shape is assumed")
    parser.add_argument(
        "--from",
        dest="from_recording",
        type=Path,
        metavar="RECORDING|PID",
        help=(
            "calibrate by a run: its recording (memtop record, an agent wire recording) or the "
            "pid of a live agent; with --measured-batch, predicts the peak at --batch and the "
            "largest batch"
        ),
    )
    parser.add_argument(
        "--measured-seq",
        type=int,
        default=None,
        metavar="S",
        help="the recorded run's sequence length: predictions at --seq scale by tokens",
    )
    parser.add_argument(
        "--measured-batch",
        type=int,
        default=None,
        metavar="N",
        help="the batch the recorded run used at its peak (with --from)",
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument(
        "--master-weights", action="store_true", help="an fp32 copy of 16-bit trainable weights"
    )
    parser.add_argument(
        "--autocast", action="store_true", help="fp32 weights, 16-bit activations (torch.autocast)"
    )
    parser.add_argument(
        "--lora-rank", type=int, default=None, help="train LoRA adapters of this rank"
    )
    parser.add_argument(
        "--lora-targets",
        default="",
        help="comma-separated matrices (q_proj,v_proj,... or all-linear; default PEFT's)",
    )
    parser.add_argument(
        "--qlora", action="store_true", help="4-bit NF4 base under LoRA (default rank 16)"
    )
    parser.add_argument("--quantize-base", choices=["4bit", "8bit"], default=None)
    parser.add_argument(
        "--adapter-dtype",
        default="fp32",
        choices=sorted(DTYPE_BYTES),
        help="LoRA adapters' dtype: fp32 (PEFT's default) or bf16 (the QLoRA paper's script)",
    )
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="optimizer state and master weights in CPU memory (DeepSpeed ZeRO-Offload)",
    )
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs (for ZeRO)")
    parser.add_argument(
        "--checkpointing", default="none", choices=CHECKPOINTING, help="activation recomputation"
    )
    parser.add_argument(
        "--attention",
        default="sdpa",
        choices=ATTENTION,
        help="sdpa (fused, the default of torch and transformers) or eager (stores the scores)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="micro-batch per GPU (default 1; with --from, the measured one)",
    )
    parser.add_argument("--seq", type=int, default=2048, help="sequence length in tokens")
    parser.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="NAME",
        help=(
            f"fit in this GPU ({', '.join(NAMED_GPUS)}) or this much memory (24GiB, 8.5GB); "
            "default: this machine's GPUs"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def architecture(args: argparse.Namespace) -> Architecture:
    if args.preset:
        return PRESETS[args.preset]
    if args.config is not None:
        return load_hf_config(args.config)
    return assumed_shape(parse_count(args.params))


def setup_from(args: argparse.Namespace) -> Setup:
    rank = args.lora_rank
    quantize = args.quantize_base
    if rank is not None and rank < 1:
        raise EstimateUsageError(f"--lora-rank {rank}: a LoRA rank must be at least 1")
    if args.qlora:
        quantize = quantize or "4bit"
        rank = rank or 16
    rank = rank or 0
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    if targets and not rank:
        raise EstimateUsageError("--lora-targets needs --lora-rank")
    return Setup(
        dtype=args.dtype,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        autocast=args.autocast,
        lora_rank=rank,
        lora_targets=targets,
        quantize_base=quantize,
        zero_stage=args.zero,
        gpus=args.gpus,
        checkpointing=args.checkpointing,
        attention=args.attention,
        batch=1 if args.batch is None else args.batch,
        seq=args.seq,
        adapter_dtype=args.adapter_dtype,
        offload_optimizer=args.offload_optimizer,
    )


def targets_from(names: list[str]) -> list[Target]:
    if names:
        targets = []
        for name in names:
            try:
                found = parse_gpu(name)
            except ValueError as exc:
                raise EstimateUsageError(str(exc)) from None
            targets.append(Target(found[0], found[1], "named"))
        return targets
    return local_gpus()


def local_gpus() -> list[Target]:
    """This machine's GPUs through NVML; none (no verdict) when there is no driver."""
    from memtop.sources.nvml import NvmlSource

    source = NvmlSource()
    try:
        reading = source.read()
    finally:
        source.close()
    return [
        Target(d.name, d.total_bytes, "nvml", d.index) for d in reading.devices if d.total_bytes
    ]


def run(args: argparse.Namespace) -> int:
    if args.from_recording is not None:
        return run_calibrated(args)
    if args.preset is None and args.config is None and args.params is None:
        raise EstimateUsageError("say what to estimate: --preset, --config, --params or --from")
    try:
        arch = architecture(args)
    except ArchitectureError as exc:
        # A config file that cannot be read is an error; a bad --params value a usage error.
        raise (EstimateError if args.config is not None else EstimateUsageError)(str(exc)) from None
    try:
        est = estimate(arch, setup_from(args))
    except ArchitectureError as exc:
        raise EstimateUsageError(str(exc)) from None
    targets = targets_from(args.gpu)
    if args.json:
        print(json.dumps(to_json(est, targets), indent=2))
    else:
        print(to_text(est, targets))
        if not targets:
            print("no GPU found here: name one with --gpu (e.g. --gpu h100-80gb)")
    return 0


def run_calibrated(args: argparse.Namespace) -> int:
    """`--from RECORDING`: the run's own peak, weights and optimizer state at its batch, fitted
    (memtop.estimate.calibrate) and asked about --batch and the GPU(s)."""
    from memtop import protocol
    from memtop.estimate.calibrate import BatchModel
    from memtop.estimate.measured import MeasuredError, from_recording, from_replies

    if args.preset or args.config is not None or args.params:
        raise EstimateUsageError(
            "--from measures the model itself: leave out --preset/--config/--params"
        )
    if args.measured_batch is None or args.measured_batch < 1:
        raise EstimateUsageError("--from needs --measured-batch N: the batch the recorded run used")
    if args.batch is not None and args.batch < 1:
        raise EstimateUsageError(f"--batch {args.batch}: a batch must be at least 1")
    live = getattr(args, "live_replies", None)
    try:
        if live is not None:
            # `--from PID`: the CLI asked the agent (memtop.cli, the same checks as cleanup).
            pid, sample, breakdown = live
            measured = from_replies(
                pid,
                protocol.parse_sample(sample),
                protocol.parse_reply("breakdown", breakdown) if breakdown else None,
            )
        else:
            measured = from_recording(args.from_recording)
    except MeasuredError as exc:
        raise EstimateError(str(exc)) from None
    except protocol.ProtocolError as exc:
        raise EstimateError(f"the agent sent a malformed reply: {exc.message}") from None
    # With both sequence lengths given, activations scale with the tokens of a batch (b·s,
    # fused attention): the measured batch counts as this many batches of --seq tokens.
    measured_seq = args.measured_seq
    if measured_seq is not None and measured_seq < 1:
        raise EstimateUsageError(f"--measured-seq {measured_seq}: must be at least 1")
    equivalent = args.measured_batch * (measured_seq or args.seq) / args.seq
    model = BatchModel.fit(
        equivalent, measured.peak_bytes, measured.reserved_bytes, measured.fixed_bytes
    )
    targets = targets_from(args.gpu) if args.gpu else []
    if not targets and measured.memory == "host":
        targets = [Target("this machine's memory", measured.total_bytes, "host")]
    if not targets:
        targets = [
            Target(f"GPU {measured.device} of the recording", measured.total_bytes, "recording")
        ]
    batch = args.measured_batch if args.batch is None else args.batch
    result = calibrated_json(measured.as_dict(), model, targets, batch, str(args.from_recording))
    calibration = result["calibration"]
    calibration["measured_batch"] = args.measured_batch
    if measured_seq is not None:
        tokens = args.measured_batch * measured_seq
        calibration.update(
            measured_seq=measured_seq,
            seq=args.seq,
            activation_bytes_per_token=round(model.growing_bytes / tokens),
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(calibrated_text(result))
    return 0
