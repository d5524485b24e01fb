"""`memtop estimate`: its arguments and what it prints.  The arithmetic is in memory.py; this
module only turns arguments into a Setup, finds the GPUs to fit in and prints."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from memtop.base.errors import MemtopError
from memtop.estimate.architecture import (
    PRESETS,
    Architecture,
    ArchitectureError,
    UnreadConfigKey,
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
from memtop.estimate.serving import KV_DTYPES, ServeSetup
from memtop.model import DriverReading


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
        metavar="RECORDING|PID",
        help=(
            "calibrate by a run: its recording (memtop record, an agent wire recording) or the "
            "pid of a live agent (a number is a pid: name a file ./22035); with "
            "--measured-batch, predicts the peak at --batch and the largest batch"
        ),
    )
    parser.add_argument(
        "--pid",
        type=int,
        default=None,
        help="with --from RECORDING of several trainers: the one to calibrate by",
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
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPE_BYTES),
        help="the trainable weights' dtype (default bf16; fp32 with --autocast)",
    )
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument(
        "--master-weights", action="store_true", help="an fp32 copy of 16-bit trainable weights"
    )
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="mixed precision as HF bf16=True runs it: fp32 weights, 16-bit activations "
        "(torch.autocast)",
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
    parser.add_argument(
        "--seq",
        "--context",
        dest="seq",
        type=int,
        default=2048,
        help="sequence length in tokens (serving: the context a sequence holds)",
    )
    parser.add_argument(
        "--ep", type=int, default=1, metavar="N", help="expert parallel: experts split over N GPUs"
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        metavar="C",
        help="experts' buffers sized for C × their share of the tokens (default: dropless)",
    )
    serve = parser.add_argument_group("serving (--serve): generation, not training")
    serve.add_argument(
        "--serve",
        "--inference",
        dest="serve",
        action="store_true",
        help="estimate serving for generation: weights, KV cache, prefill, not training",
    )
    serve.add_argument(
        "--quantize",
        default=None,
        metavar="FORMAT",
        help="served weights: 4bit, 8bit (bitsandbytes), fp8, mxfp4, gptq-4bit-g128, "
        "awq-4bit-g128 (default --dtype, or the config's quantization_config)",
    )
    serve.add_argument(
        "--kv-dtype", default=None, choices=sorted(KV_DTYPES), help="KV cache dtype (default bf16)"
    )
    serve.add_argument(
        "--concurrency", type=int, default=1, metavar="N", help="sequences generated at once"
    )
    serve.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel GPUs")
    serve.add_argument(
        "--prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens one forward pass takes (vLLM's max_num_batched_tokens; default the context)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="U",
        help="vLLM's budget: the KV cache it leaves and the concurrency it would report",
    )
    serve.add_argument(
        "--offload-layers",
        type=int,
        default=0,
        metavar="N",
        help="keep N layers' weights in CPU memory (streamed over PCIe each token)",
    )
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
    serving = [k for k, default in SERVE_ONLY.items() if getattr(args, k) != default]
    if serving:
        raise EstimateUsageError(
            f"--{serving[0].replace('_', '-')} is a serving setting: add --serve (generation), "
            "or leave it out for training"
        )
    if args.quantize_base and not rank:
        raise EstimateUsageError(
            "--quantize-base trains LoRA adapters over a quantized base: give --lora-rank "
            "(or --qlora); to serve a quantized model use --serve --quantize"
        )
    dtype = args.dtype or ("fp32" if args.autocast else "bf16")
    if args.autocast and dtype != "fp32":
        raise EstimateUsageError(
            f"--autocast runs over fp32 weights (HF bf16=True): leave out --dtype {dtype}, or "
            "use --master-weights for 16-bit weights with an fp32 master copy"
        )
    return Setup(
        dtype=dtype,
        expert_parallel=args.ep,
        capacity_factor=args.capacity_factor,
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
    """This machine's GPUs through every driver library memtop reads (NVIDIA's NVML, AMD's
    amdsmi: memtop.sources.devices), each with what is free on it now; none (no verdict) when
    no driver answers."""
    from memtop.sources.devices import DRIVERS, CombinedDeviceSource

    source = CombinedDeviceSource([make() for make in DRIVERS], _NoFallback())
    try:
        reading = source.read()
    finally:
        source.close()
    if not reading.available:
        return []
    # A GPU in MIG mode runs nothing itself: its instances (devices of their own) are the
    # GPUs a trainer gets.
    return [
        Target(d.name, d.total_bytes, reading.source, d.index, d.free_bytes)
        for d in reading.devices
        if d.total_bytes and not d.mig_mode
    ]


class _NoFallback:
    """No simulated GPUs for an estimate: a demo's GPUs are not this machine's."""

    source = "none"

    def read(self) -> DriverReading:
        return DriverReading(available=False, devices=(), source="none")

    def close(self) -> None:
        pass


def run(args: argparse.Namespace) -> int:
    if args.from_recording is not None:
        return run_calibrated(args)
    if args.preset is None and args.config is None and args.params is None:
        raise EstimateUsageError("say what to estimate: --preset, --config, --params or --from")
    try:
        arch = architecture(args)
    except UnreadConfigKey as exc:
        raise EstimateUsageError(str(exc)) from None  # DESIGN §13: exit 2
    except ArchitectureError as exc:
        # A config file that cannot be read is an error; a bad --params value a usage error.
        raise (EstimateError if args.config is not None else EstimateUsageError)(str(exc)) from None
    if args.serve:
        return run_serve(args, arch)
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


# Training flags that mean nothing when serving: refused rather than silently ignored.
TRAINING_ONLY = {
    "optimizer": "adamw", "master_weights": False, "autocast": False, "lora_rank": None,
    "qlora": False, "quantize_base": None, "offload_optimizer": False, "zero": 0, "gpus": 1,
    "checkpointing": "none", "batch": None, "ep": 1, "lora_targets": "",
    "capacity_factor": None,
}  # fmt: skip
SERVE_ONLY = {
    "quantize": None, "kv_dtype": None, "concurrency": 1, "tp": 1, "prefill_tokens": None,
    "gpu_memory_utilization": None, "offload_layers": 0,
}  # fmt: skip


def serve_setup_from(args: argparse.Namespace, arch: Architecture) -> ServeSetup:
    given = [k for k, default in TRAINING_ONLY.items() if getattr(args, k) != default]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise EstimateUsageError(
            f"{flag} is a training setting: --serve estimates generation (no gradients or "
            "optimizer); say the concurrency with --concurrency"
        )
    weights = args.quantize or arch.checkpoint_weights or args.dtype or "bf16"
    return ServeSetup(
        weights=weights,
        kv_dtype=args.kv_dtype or "bf16",
        context=args.seq,
        concurrency=args.concurrency,
        tp=args.tp,
        prefill_tokens=args.prefill_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        offload_layers=args.offload_layers,
    )


def run_serve(args: argparse.Namespace, arch: Architecture) -> int:
    from memtop.estimate.render import serve_json, serve_text
    from memtop.estimate.serving import serve_estimate

    try:
        setup = serve_setup_from(args, arch)
        est = serve_estimate(arch, setup)
    except ArchitectureError as exc:
        raise EstimateUsageError(str(exc)) from None
    targets = targets_from(args.gpu)
    if args.json:
        print(json.dumps(serve_json(est, targets), indent=2))
    else:
        print(serve_text(est, targets))
        if not targets:
            print("no GPU found here: name one with --gpu (e.g. --gpu rtx4090)")
    return 0


def run_calibrated(args: argparse.Namespace) -> int:
    """`--from RECORDING`: the run's own peak, weights and optimizer state at its batch, fitted
    (memtop.estimate.calibrate) and asked about --batch and the GPU(s)."""
    from memtop import protocol
    from memtop.estimate.calibrate import BatchModel
    from memtop.estimate.measured import (
        ChooseTrainer,
        MeasuredError,
        from_recording,
        from_replies,
    )

    if args.preset or args.config is not None or args.params:
        raise EstimateUsageError(
            "--from measures the model itself: leave out --preset/--config/--params"
        )
    if args.serve:
        raise EstimateUsageError("--from calibrates training: leave out --serve")
    if args.measured_batch is None or args.measured_batch < 1:
        raise EstimateUsageError("--from needs --measured-batch N: the batch the recorded run used")
    if args.batch is not None and args.batch < 1:
        raise EstimateUsageError(f"--batch {args.batch}: a batch must be at least 1")
    live = getattr(args, "live_replies", None)
    if live is not None and args.pid is not None:
        raise EstimateUsageError("--pid chooses a trainer of a recording: --from PID names one")
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
            measured = from_recording(Path(args.from_recording), args.pid)
    except ChooseTrainer as exc:
        raise EstimateUsageError(str(exc)) from None
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
