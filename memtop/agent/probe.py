"""The interface between the agent and an allocator: torch on an accelerator, or the simulator.

The agent's modules (server, handlers, boundary, oom, sites, auto_cleanup) talk only to a
`Probe`.  Its implementations:
- `memtop.agent.torch_probe.TorchProbe`: torch's side that is the same on every accelerator
  (the optimizer step hooks, the breakdown walk, autograd's pass, torch's version) over a
  `DeviceBackend`: the accelerator's allocator and devices.  The backends are modules of
  `memtop.agent.backends` (CUDA/ROCm: `backends/cuda.py`, the only code of memtop that names
  torch.cuda), chosen by that package's registry; a second accelerator is one more module and
  its line there.
- `memtop.agent.lazy_probe.LazyTorchProbe`: a TorchProbe once the program has imported torch.
- `memtop.sim.probe.SimulatedProbe`: the simulated caching allocator (`memtop demo`, the tests).

Each method says which thread may call it (DESIGN §6, "thread discipline"), with the
`any_thread` / `trainer_thread` marks below; `tests/test_probe_seam.py` reads the marks and checks
that the agent's own threads never call a `trainer_thread` method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from memtop.protocol import replies

ThreadRule = Literal["any", "trainer"]
_Method = TypeVar("_Method", bound=Callable[..., Any])


def any_thread(method: _Method) -> _Method:
    """Mark: any thread may call it, the agent's included.  A host-side read or bookkeeping
    that touches no tensor and makes no device-runtime call that could synchronise, initialise
    a device or disturb a graph capture."""
    method.__memtop_thread__ = "any"  # type: ignore[attr-defined]
    return method


def trainer_thread(method: _Method) -> _Method:
    """Mark: the trainer's thread only, at a step boundary (the agent runs it as a trainer job
    from the step hook or memtop.step()), never while a graph is captured; the OOM observer
    may also call it on the allocating thread.  Never the agent's own threads."""
    method.__memtop_thread__ = "trainer"  # type: ignore[attr-defined]
    return method


def thread_rule(interface: type, name: str) -> ThreadRule | None:
    """The mark of `interface`'s method `name` (None: unmarked, or no such method)."""
    rule = getattr(getattr(interface, name, None), "__memtop_thread__", None)
    return rule if rule in ("any", "trainer") else None


def interface_methods(interface: type) -> dict[str, ThreadRule | None]:
    """Every public method `interface` declares itself and its bases, with its mark (None when
    it has none, which tests/test_probe_seam.py refuses)."""
    names = {
        name
        for klass in interface.__mro__
        if klass not in (object, Protocol) and klass.__module__ == __name__
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    }
    return {name: thread_rule(interface, name) for name in sorted(names)}


@dataclass(frozen=True, slots=True)
class ProbeDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int
    # protocol.canonical_pci_bus_id form, where torch gives the numbers: on ROCm the viewer joins
    # the device with amdsmi's by it (torch's UUID there is HIP's, not the driver's).
    pci_bus_id: str | None = None


# The variables torch's caching allocator reads its options from.  PYTORCH_HIP_ALLOC_CONF is
# the ROCm spelling: torch's ROCm builds read it when the others are unset (c10/core/
# AllocatorConfig.cpp, AcceleratorAllocatorConfig::instance; before 2.9 c10/cuda/
# CUDAAllocatorConfig.h under USE_ROCM).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def allocator_conf_from_env(env: Mapping[str, str]) -> str:
    """The allocator options of a process with environment `env` (the first variable set)."""
    return next((env[name] for name in ALLOC_CONF_VARIABLES if env.get(name)), "")


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Bytes of one device by role; `other` (activations, temporaries) is the remainder."""

    parameters: int
    gradients: int
    optimizer_state: int
    allocated: int
    # How many parameters are stored in fp32 (a bf16 saving is half of their bytes).
    fp32_parameter_bytes: int = 0

    @property
    def other(self) -> int:
        return max(0, self.allocated - self.parameters - self.gradients - self.optimizer_state)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "other": self.other,
            "allocated": self.allocated,
            "fp32_parameter_bytes": self.fp32_parameter_bytes,
        }


StepCallback = Callable[[], None]

# The documented subset of torch.cuda.memory_stats() keys that `sample` carries (DESIGN §6):
# every key memtop's viewer, its JSON report and its exporters read, and a few that explain them.
# Building only these is what keeps a `sample` cheap on the trainer's GIL.
# The subset of torch.cuda.memory_stats() keys a `sample` carries: every key memtop or its JSON
# report reads.  Part of the wire schema, so its home is the protocol.
SAMPLE_STAT_KEYS = replies.SAMPLE_STAT_KEYS


OomObserver = Callable[[int, int, int, int], None]


class DeviceMemory(Protocol):
    """An accelerator's allocator and devices, as torch exposes them: what changes from CUDA to
    XPU to MPS, and what a Probe offers of them.

    None may initialise the device runtime or create a context on a device the trainer has not
    used: until the trainer has, there are no devices.  Every call is wrapped by the agent,
    which turns an exception into an error frame.
    """

    @any_thread
    def devices(self) -> list[ProbeDevice]:
        """Devices the trainer has used so far (possibly none yet)."""
        ...

    @any_thread
    def memory_stats(self, index: int) -> dict[str, int]:
        """The allocator's host-side counters, at least SAMPLE_STAT_KEYS (torch.cuda's names)."""
        ...

    @any_thread
    def memory_allocated(self, index: int) -> int:
        """Cheap: read behind step marks by the step hook (0 before the device is in use)."""
        ...

    @any_thread
    def reset_peak(self, index: int) -> None:
        """Resets a host-side counter."""
        ...

    @trainer_thread
    def is_capturing(self) -> bool:
        """Whether a graph is being captured on the trainer's current stream (when in doubt,
        True: the boundary then touches nothing)."""
        ...

    @trainer_thread
    def mem_get_info(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of the device as the driver sees it."""
        ...

    @trainer_thread
    def empty_cache(self, index: int) -> None:
        """Hand the allocator's unused cached blocks back to the driver."""
        ...

    @trainer_thread
    def snapshot(self) -> dict[str, Any]:
        """torch.cuda.memory._snapshot()'s format: {"segments": [...], "device_traces": [...]}
        (empty lists while no device is in use)."""
        ...


class DeviceBackend(DeviceMemory, Protocol):
    """One accelerator's `DeviceMemory`, under `TorchProbe`: one module of
    `memtop.agent.backends` per accelerator (CUDA and ROCm share torch.cuda: `backends/cuda.py`).

    A backend module has `detect() -> DeviceBackend | None` (None: this process's torch has no
    such accelerator; cheap, and it too must initialise nothing) and `NAME`; of `BackendExtras`
    it implements what it can.
    """

    # Which tensors the breakdown counts: torch's device type ("cuda": `tensor.is_cuda`).
    tensor_device_type: str


class BackendExtras(Protocol):
    """What a backend (or a Probe) may also have; the agent asks with getattr, and without one
    the feature says in one line that it is not there."""

    @any_thread
    def hip_version(self) -> str | None:
        """torch.version.hip on a ROCm build (a probe without it is taken to run on CUDA)."""
        ...

    @any_thread
    def mark_reading(self, index: int) -> tuple[int, int, int]:
        """(allocated now, its peak, bytes ever allocated) from one allocator read: what a step
        mark records (without it a mark holds memory_allocated() alone)."""
        ...

    @any_thread
    def allocator_settings(self) -> str | None:
        """The allocator's option string in force (None: unknown).  Without it and its setter,
        `memtop tune` is refused in one line."""
        ...

    @trainer_thread
    def set_allocator_settings(self, text: str) -> None:
        """Replace the whole option string (torch resets every key it leaves out); raises
        NotImplementedError where this torch cannot."""
        ...

    @trainer_thread
    def record_history(self, enabled: bool) -> bool:
        """Stack recording on or off (state only, allocation context, Python frames); False
        while no device is in use.  Without it there are no sites from live blocks."""
        ...

    @any_thread
    def attach_oom_observer(self, observer: OomObserver) -> bool:
        """Have `observer(device, requested, limit, free)` called at every out-of-memory, on
        the allocating thread with the allocator's lock released (False: none possible).
        Called once, from the thread that starts the agent; it must initialise nothing."""
        ...

    @any_thread
    def current_pass(self) -> str | None:
        """The calling (allocating) thread's pass, for an OOM report: forward, backward,
        optimizer, no_grad."""
        ...


class Probe(DeviceMemory, Protocol):
    """What the agent needs: an accelerator's memory, and torch's side that no accelerator
    changes.

    The optional methods are `BackendExtras`'; every method carries its thread mark (DESIGN §6:
    the agent thread calls only `any_thread` ones, and runs the `trainer_thread` ones as
    trainer jobs from the step boundary).
    """

    @any_thread
    def torch_version(self) -> str | None:
        """torch.__version__ (None: no torch)."""
        ...

    @any_thread
    def allocator_conf(self) -> str:
        """The allocator options of the process's environment, as it started."""
        ...

    @trainer_thread
    def breakdown(self) -> dict[int, Breakdown]:
        """Right after an optimizer step (gradients alive): bytes by role per device."""
        ...

    @any_thread
    def install_step_hook(self, on_step: StepCallback) -> bool:
        """Arrange for `on_step` after every optimizer step; False when there is no such hook.
        Registering torch's global hook touches no tensor (the lazy probe's waiter does it)."""
        ...

    @any_thread
    def remove_step_hook(self) -> None:
        """Undo install_step_hook (torch's hook is process-global)."""
        ...
