"""What a process on a GPU is (DESIGN §13 "Servers"): a trainer, an inference server, or a
preallocator such as JAX, and what share of the GPU it asked for on purpose.

An inference server takes most of a GPU when it starts and keeps it: vLLM reserves
`--gpu-memory-utilization` of the GPU (0.9 unless told), SGLang `--mem-fraction-static`, TGI
`--cuda-memory-fraction` (1.0), TensorRT-LLM `free_gpu_memory_fraction` of the memory still free
after the weights (0.9), and JAX/XLA preallocates `XLA_PYTHON_CLIENT_MEM_FRACTION` of it (0.75)
unless `XLA_PYTHON_CLIENT_PREALLOCATE=false`.  Judged by the usage thresholds of a trainer, each
is an emergency forever; judged by what it asked for, it is on purpose (memtop.diagnosis.
suggestions' usage rule reads `budget_share`).

Recognised from, in this order: the process's command line (and its launcher's: vLLM's and
SGLang's engine processes rename themselves, "VLLM::EngineCore", and keep no flags), its
environment (ENGINE_ENVIRONMENT only: through its agent's `hello`, else /proc/PID/environ where
the viewer may read it), and, for a PyTorch process with an agent and no steps, the pattern: its
reserved bytes at a high share of the GPU from the first sample on and flat since.

Pure functions of plain data: the reading is memtop.sources.processes' and the agent's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from memtop.base.records import record
from memtop.model import Choice


class WorkloadKind(Choice):
    """The JSON's `kind` of a process."""

    TRAINER = "trainer"  # it steps (optimizer steps or memtop.step())
    SERVER = "server"  # an inference engine (argv), or a PyTorch process flat at a high share
    PREALLOCATOR = "preallocator"  # takes a set share at start whatever it does (JAX/XLA)
    PROCESS = "process"  # a PyTorch process with no steps yet: not judged as a trainer


class BudgetBasis(Choice):
    TOTAL = "total"  # a share of the GPU's total memory
    FREE = "free"  # a share of the memory free when it started (TensorRT-LLM's KV cache)


@record(frozen=True, slots=True)
class Engine:
    """An inference engine that takes a share of its GPU on purpose, and how it is told that
    share."""

    id: str  # the JSON's `engine`
    name: str  # as people write it
    programs: tuple[str, ...]  # program basenames, `python -m` modules (their first part) …
    flags: tuple[str, ...]  # the flags that set its share (compared with `_` and `-` alike)
    default: float | None  # the share it takes when not told; None: it picks one itself
    environment: str | None = None  # a variable that sets the share too
    basis: BudgetBasis = BudgetBasis.TOTAL


ENGINES: tuple[Engine, ...] = (
    Engine("vllm", "vLLM", ("vllm",), ("--gpu-memory-utilization",), 0.9),
    # SGLang sizes its static pool from the GPU and the parallelism when not told.
    Engine("sglang", "SGLang", ("sglang",), ("--mem-fraction-static",), None),
    Engine(
        "tgi",
        "TGI",
        ("text-generation-launcher", "text-generation-server", "text_generation_server"),
        ("--cuda-memory-fraction",),
        1.0,
        environment="CUDA_MEMORY_FRACTION",
    ),
    Engine(
        "tensorrt-llm",
        "TensorRT-LLM",
        ("trtllm-serve", "trtllm-llmapi-launch", "tensorrt_llm"),
        ("--kv-cache-free-gpu-memory-fraction", "--free-gpu-memory-fraction"),
        0.9,
        basis=BudgetBasis.FREE,
    ),
)
JAX = "jax"
JAX_DEFAULT_SHARE = 0.75
JAX_FRACTION_VARIABLES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
ENGINE_NAMES = {**{e.id: e.name for e in ENGINES}, JAX: "JAX"}

# The pattern of a preallocating PyTorch process seen through its agent: reserved at least this
# share of the GPU from its first sample on, within FLAT_SHARE of the GPU ever since, over at
# least PATTERN_SAMPLES samples, with no step, retry or OOM.
PATTERN_MIN_SHARE = 0.5
FLAT_SHARE = 0.02
PATTERN_SAMPLES = 10


@record(frozen=True, slots=True)
class Workload:
    """What a process is (a trainer, or an engine that preallocates) and the share of its GPU
    it takes on purpose."""

    kind: WorkloadKind
    engine: str | None = None  # an ENGINES id or "jax"; None: not recognised
    budget_share: float | None = None  # the share of the GPU it takes on purpose
    setting: str | None = None  # what sets it, as the user would change it
    basis: BudgetBasis = BudgetBasis.TOTAL
    source: str | None = None  # "argv", "launcher", "environment", "default", "pattern"

    @property
    def preallocates(self) -> bool:
        return self.budget_share is not None

    @property
    def label(self) -> str:
        """What the process table says of it: "vLLM · 0.90 of GPU"; "" for a trainer."""
        name = ENGINE_NAMES.get(self.engine or "", "")
        if self.budget_share is None:
            return name
        of = "of free GPU" if self.basis == BudgetBasis.FREE else "of GPU"
        return f"{name or 'preallocated'} · {self.budget_share:.2f} {of}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "engine": self.engine,
            "budget_share": self.budget_share,
            "setting": self.setting,
            "budget_basis": self.basis.value if self.budget_share is not None else None,
            "source": self.source,
        }


TRAINER = Workload(WorkloadKind.TRAINER)
NO_STEPS = Workload(WorkloadKind.PROCESS)


def _program(argv: Sequence[str]) -> str:
    """The program a command line runs: the module of `python -m module`, the script of
    `python script` (a console script such as `vllm` runs as `python /usr/bin/vllm`), else its
    own basename; lower case.  A process title ("VLLM::EngineCore") is its own program."""
    args = list(argv)
    if not args:
        return ""
    first = os.path.basename(args[0]).lower()
    if first.startswith("python") and len(args) > 1:
        rest = args[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]  # interpreter options (-u, -O, -X …)
        if len(rest) >= 2 and rest[0] == "-m":
            return rest[1].lower()
        if rest:
            return os.path.basename(rest[0]).lower()
    return first


def _is(engine: Engine, program: str) -> bool:
    head = program.split("::", 1)[0]  # "vllm::enginecore", "sglang::scheduler"
    for name in engine.programs:
        if head == name or head.startswith(name + ".") or head.startswith(name + "_"):
            return True
    return False


def _share(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if 0.0 < value <= 1.0 else None


def _flag(argv: Sequence[str], flags: Sequence[str]) -> tuple[str, float | None] | None:
    """The flag of `flags` given in `argv` (the last one wins, as argparse reads it) and its
    value (None when it is not a share)."""
    wanted = {f.replace("_", "-") for f in flags}
    found: tuple[str, float | None] | None = None
    args = list(argv)
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name.replace("_", "-") not in wanted:
            continue
        text = value if equals else (args[i + 1] if i + 1 < len(args) else None)
        found = (name, _share(text))
    return found


# recognise() is asked about every agent device and every process on a GPU each round (the
# dashboard's observation, once a second), about the same command lines round after round: its
# answers are kept, keyed by what it reads (its answer is a function of those alone).  A cap,
# not an LRU: command lines come and go slowly, and a full table is simply started again.
RECOGNISED_ENTRIES = 1024
_recognised: dict[tuple[object, ...], Workload | None] = {}
_UNKNOWN = object()  # not asked yet (None is an answer: nothing recognised)


def recognise(
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    launcher_argv: Sequence[str] = (),
) -> Workload | None:
    """The inference engine or preallocator a process is, with its share; None when neither its
    command line, its launcher's nor its environment says."""
    try:
        key = (tuple(argv), tuple(launcher_argv), tuple(sorted((environ or {}).items())))
        found = _recognised.get(key, _UNKNOWN)
    except TypeError:  # something in them that cannot be a key (not a string): read it afresh
        return _recognise(argv, environ, launcher_argv)
    if found is _UNKNOWN:
        found = _recognise(argv, environ, launcher_argv)
        if len(_recognised) >= RECOGNISED_ENTRIES:
            _recognised.clear()
        _recognised[key] = found
    return found  # type: ignore[return-value]


def _recognise(
    argv: Sequence[str],
    environ: Mapping[str, str] | None,
    launcher_argv: Sequence[str],
) -> Workload | None:
    environ = environ or {}
    for source, args in (("argv", argv), ("launcher", launcher_argv)):
        program = _program(args)
        engine = next((e for e in ENGINES if _is(e, program)), None)
        if engine is None:
            continue
        # The flag where it is given: on the process itself, else on its launcher (an engine
        # process that renamed itself, or a worker its server started, has none of its own).
        for where, flags_in in (("argv", argv), ("launcher", launcher_argv)):
            given = _flag(flags_in, engine.flags)
            if given is not None and given[1] is not None:
                flag, told = given[0], given[1]
                return _server(engine, told, f"{flag} {told:g}", where)
        share = _share(environ.get(engine.environment)) if engine.environment else None
        if engine.environment and share is not None:
            return _server(engine, share, f"{engine.environment}={share:g}", "environment")
        if engine.default is not None:
            flag = engine.flags[0]
            return _server(
                engine, engine.default, f"{flag} (default {engine.default:g})", "default"
            )
        return Workload(
            WorkloadKind.SERVER,
            engine.id,
            None,
            f"{engine.flags[0]} (set by {engine.name})",
            source=source,
        )
    return _jax(environ)


def _server(engine: Engine, share: float, setting: str, source: str) -> Workload:
    return Workload(WorkloadKind.SERVER, engine.id, share, setting, engine.basis, source)


def _jax(environ: Mapping[str, str]) -> Workload | None:
    """JAX/XLA, told by its variables (a JAX process without any is found by the pattern only,
    and only with an agent)."""
    if not any(
        name in environ
        for name in (
            *JAX_FRACTION_VARIABLES,
            "XLA_PYTHON_CLIENT_PREALLOCATE",
            "XLA_PYTHON_CLIENT_ALLOCATOR",
        )
    ):
        return None
    if environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("false", "0"):
        return Workload(
            WorkloadKind.PROCESS,
            JAX,
            None,
            "XLA_PYTHON_CLIENT_PREALLOCATE=false",
            source="environment",
        )
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
        return Workload(
            WorkloadKind.PROCESS,
            JAX,
            None,
            "XLA_PYTHON_CLIENT_ALLOCATOR=platform",
            source="environment",
        )
    for name in JAX_FRACTION_VARIABLES:
        if (share := _share(environ.get(name))) is not None:
            return Workload(
                WorkloadKind.PREALLOCATOR, JAX, share, f"{name}={share:g}", source="environment"
            )
    return Workload(
        WorkloadKind.PREALLOCATOR,
        JAX,
        JAX_DEFAULT_SHARE,
        f"XLA_PYTHON_CLIENT_MEM_FRACTION (default {JAX_DEFAULT_SHARE:g})",
        source="default",
    )


def flat_high_share(reserved: Sequence[float], total: int, retries: int, ooms: int) -> float | None:
    """The share of the GPU a process without steps holds on purpose, judged by the pattern: at
    least PATTERN_MIN_SHARE from its first sample on and within FLAT_SHARE ever since, with no
    retry and no OOM; None when its samples do not show that."""
    if total <= 0 or len(reserved) < PATTERN_SAMPLES or retries or ooms:
        return None
    low, high = min(reserved), max(reserved)
    if reserved[0] < PATTERN_MIN_SHARE * total or high - low > FLAT_SHARE * total:
        return None
    return round(high / total, 2)


def of_agent(
    argv: Sequence[str],
    environ: Mapping[str, str] | None,
    launcher_argv: Sequence[str],
    stepped: bool,
    pattern_share: float | None,
) -> Workload:
    """What a process with an agent is: a recognised engine first (a server that calls
    memtop.step() per request batch is still a server), then a trainer when it steps, then a
    preallocating server by the pattern, else a PyTorch process with no steps."""
    found = recognise(argv, environ, launcher_argv)
    if found is not None and found.kind != WorkloadKind.PROCESS:
        return found
    if stepped:
        return TRAINER
    if pattern_share is not None:
        return Workload(WorkloadKind.SERVER, None, pattern_share, None, source="pattern")
    return found or NO_STEPS
