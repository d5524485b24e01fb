"""The real probe: torch.cuda inside the trainer.  The only module of memtop that imports torch.

Rules it keeps:
- it never initialises CUDA: until the trainer has initialised it, there are no devices;
- it only reads devices the trainer has a context on, so it creates no context elsewhere;
- every call is wrapped by the agent, which turns any exception into an error frame.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memtop.agent.probe import (
    SAMPLE_STAT_KEYS,
    Breakdown,
    ProbeDevice,
    StepCallback,
    allocator_conf_from_env,
)
from memtop.protocol.text import pci_bus_id_of

_register_step_post_hook: Callable[..., Any] | None
_register_step_pre_hook: Callable[..., Any] | None
try:
    # `torch.optim.optimizer` is not an attribute of `torch.optim` (its __init__ deletes the
    # submodule names), so the hook must be imported from the module itself.
    from torch.optim.optimizer import register_optimizer_step_post_hook as _register_step_post_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook as _register_step_pre_hook
except ImportError:  # torch < 2.0
    _register_step_post_hook = _register_step_pre_hook = None


_FakeTensor: type | None
try:
    # torch imports it itself, so this costs nothing; a fake tensor claims a real device (its
    # `is_cpu` is True) but has no data, and asking for its data_ptr() warns.
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:
    _FakeTensor = None


@dataclass(frozen=True, slots=True)
class RoleBytes:
    """Bytes of one device held by optimizers' parameters, gradients and state."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    # The part of `parameters` stored in float32.
    fp32_parameter_bytes: int = 0


_PARAMETERS, _GRADIENTS, _STATE, _FP32 = range(4)


def _device_test(device_type: str) -> Callable[[Any], bool]:
    # `tensor.is_cuda` and friends are ~6x cheaper than `tensor.device.type`, which builds a
    # torch.device for every tensor; this runs for every tensor of the model.
    # Only names known to be device tests: `is_sparse` and the like are not.
    if device_type in ("cuda", "cpu", "xpu", "mps", "meta") and hasattr(
        torch.Tensor, f"is_{device_type}"
    ):
        return operator.attrgetter(f"is_{device_type}")
    return lambda tensor: tensor.device.type == device_type


def count_optimizer_memory(
    optimizers: Iterable[Any], device_type: str = "cuda"
) -> dict[int, RoleBytes]:
    """Bytes of the tensors that `optimizers` reach, per device index, each storage counted once.

    Walks every optimizer's `param_groups[*]["params"]` (parameters), their `.grad` (gradients)
    and `optimizer.state[p]` (optimizer state: tensor values, and tensors one level down inside a
    list, tuple or dict value).  Only tensors of `device_type` count.  A storage reached more
    than once (tied weights, views, the same parameter in two optimizers) counts once, in the
    first role of parameters > gradients > optimizer_state, whichever optimizer reaches it; its
    bytes are `untyped_storage().nbytes()`.

    The key is `tensor.get_device()`: the device index, or -1 for CPU tensors (torch's own
    convention for "no index").  Tensors without a readable storage (sparse layouts, meta and
    fake tensors, empty storages) are skipped.

    Must run on the trainer's own thread, between steps (the agent calls it from the step
    boundary): walking tensors from another thread while the trainer frees them crashes torch
    (`THPStorage_dealloc` assert / SIGSEGV; shared/gpu/race.py).  Containers are still copied
    before they are walked, and a failure of one optimizer only loses that optimizer.
    """
    # Snapshot first, one optimizer at a time, so that one that cannot be walked (a custom class,
    # a concurrent add_param_group) loses only itself.
    params: list[Any] = []
    states: list[Any] = []
    for optimizer in list(optimizers):
        try:
            mine = [p for group in list(optimizer.param_groups) for p in list(group["params"])]
            state = list(optimizer.state.values())
        except Exception:
            continue
        params += mine
        states += state

    on_device = _device_test(device_type)
    seen: set[tuple[int, int]] = set()
    totals: dict[int, list[int]] = {}
    # Counted tensors are held until the end: a gradient freed by the trainer mid-count could
    # otherwise hand its address to a new tensor that would then be taken for one already seen.
    alive: list[Any] = []
    tensor_types = (torch.Tensor, torch.nn.Parameter)

    def add(tensor: Any, role: int) -> None:
        if type(tensor) not in tensor_types and (
            not isinstance(tensor, torch.Tensor)
            or (_FakeTensor is not None and isinstance(tensor, _FakeTensor))
        ):
            return  # not a tensor, or a fake one
        try:
            if not on_device(tensor):
                return
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address == 0:
                return  # meta or empty: no data, and no address to tell storages apart by
            key = (tensor.get_device(), address)
            if key in seen:
                return
            nbytes = storage.nbytes()
        except Exception:  # sparse layouts have no single storage; never raise into the agent
            return
        seen.add(key)
        alive.append(tensor)
        bucket = totals.get(key[0])
        if bucket is None:
            bucket = totals[key[0]] = [0, 0, 0, 0]
        bucket[role] += nbytes
        if role == _PARAMETERS and tensor.dtype == torch.float32:
            bucket[_FP32] += nbytes

    # One pass per role over all optimizers, so that the priority holds across optimizers too.
    for p in params:
        add(p, _PARAMETERS)
    for p in params:
        add(getattr(p, "grad", None), _GRADIENTS)
    for state in states:
        if not isinstance(state, dict):
            continue
        try:
            values = list(state.values())
        except Exception:
            continue
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in list(value):
                    add(item, _STATE)
            elif isinstance(value, dict):
                for item in list(value.values()):
                    add(item, _STATE)
            else:
                add(value, _STATE)
    return {
        index: RoleBytes(
            parameters=bucket[_PARAMETERS],
            gradients=bucket[_GRADIENTS],
            optimizer_state=bucket[_STATE],
            fp32_parameter_bytes=bucket[_FP32],
        )
        for index, bucket in totals.items()
    }


def _allocator_conf() -> str:
    return allocator_conf_from_env(os.environ)


def _pci_bus_id(props: Any) -> str | None:
    """The device's PCI address from torch's properties (pci_domain_id, pci_bus_id,
    pci_device_id: CUDA and ROCm builds of torch >= 2.3 have them), None without them."""
    names = ("pci_domain_id", "pci_bus_id", "pci_device_id")
    numbers = [getattr(props, name, None) for name in names]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        return None
    domain, bus, device = (int(n) for n in numbers if n is not None)
    return pci_bus_id_of(domain, bus, device)


# The nested path of each SAMPLE_STAT_KEYS key in torch._C._cuda_memoryStats()'s dict.
# torch's max_entries for stack recording: a bound on its trace ring (unused by enabled="state",
# which keeps only the live blocks' stacks, but bounded all the same).
HISTORY_MAX_ENTRIES = 10_000
_SAMPLE_PATHS = tuple((key, tuple(key.split("."))) for key in SAMPLE_STAT_KEYS)


def _pick_stats(nested: dict[str, Any]) -> dict[str, int]:
    """SAMPLE_STAT_KEYS out of the allocator's nested stats, without flattening all ~120."""
    out: dict[str, int] = {}
    for key, path in _SAMPLE_PATHS:
        value: Any = nested
        for part in path:
            if not isinstance(value, dict):
                break
            value = value.get(part)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = int(value)
    return out


class TorchProbe:
    def __init__(self, breakdown_device_type: str | None = None) -> None:
        # Which tensors the breakdown counts: CUDA ones, unless told otherwise (the CPU soak and
        # tests set MEMTOP_BREAKDOWN_DEVICE=cpu to exercise the walk on a machine with no GPU).
        self.breakdown_device_type = (
            breakdown_device_type or os.environ.get("MEMTOP_BREAKDOWN_DEVICE") or "cuda"
        )
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._device_cache: dict[int, ProbeDevice] = {}
        self._hook_handle: Any = None
        self._pre_hook_handle: Any = None
        self._in_optimizer_step = False  # between the step pre- and post-hooks: the OOM's pass
        self._lock = threading.Lock()

    def torch_version(self) -> str | None:
        return str(torch.__version__)

    def allocator_conf(self) -> str:
        return _allocator_conf()

    def hip_version(self) -> str | None:
        hip = getattr(torch.version, "hip", None)
        return str(hip) if hip else None

    def _used_indices(self) -> list[int]:
        # is_initialized() first: is_available() would call cudaGetDeviceCount, initialising
        # the CUDA driver in a trainer that has not (yet) touched CUDA itself.
        if not torch.cuda.is_initialized() or not torch.cuda.is_available():
            return []
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        indices = []
        for index in range(torch.cuda.device_count()):
            if has_context is None or has_context(index):
                indices.append(index)
        return indices

    def devices(self) -> list[ProbeDevice]:
        found = []
        for index in self._used_indices():
            device = self._device_cache.get(index)
            if device is None:
                props = torch.cuda.get_device_properties(index)
                # As torch gives it (bare: CUDA's cuDeviceGetUuid_v2, a MIG instance's own or,
                # through older paths, its GPU's): a `GPU-` prefix made a MIG instance's UUID
                # one the driver never lists.  The viewer compares UUIDs without the prefix.
                uuid = str(getattr(props, "uuid", "") or "")
                device = ProbeDevice(
                    index, uuid, str(props.name), int(props.total_memory), _pci_bus_id(props)
                )
                self._device_cache[index] = device
            found.append(device)
        return found

    def memory_stats(self, index: int) -> dict[str, int]:
        # torch.cuda.memory_stats() flattens and sorts all ~120 counters (150 µs on an H100);
        # the raw nested dict is 21.5 µs and holds the same numbers.  Host-side counters only.
        if not torch.cuda.is_initialized():
            return {}
        raw = getattr(torch._C, "_cuda_memoryStats", None)
        if raw is None:
            return {k: int(v) for k, v in torch.cuda.memory_stats(index).items()}
        return _pick_stats(raw(index))

    def is_capturing(self) -> bool:
        if not torch.cuda.is_initialized():
            return False
        try:
            return bool(torch.cuda.is_current_stream_capturing())
        except Exception:
            return True  # when in doubt, touch nothing

    def memory_allocated(self, index: int) -> int:
        # Runs on the trainer's thread after every step.  torch.cuda.memory_allocated() flattens
        # all ~120 allocator stats into a sorted dict first (tens of µs, a measurable share of a
        # short step); the nested dict it flattens has the same number one lookup away.
        if not torch.cuda.is_initialized():
            return 0  # as torch.cuda.memory_allocated() says, without touching CUDA
        try:
            return int(torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]["current"])
        except (AttributeError, KeyError, TypeError):
            return int(torch.cuda.memory_allocated(index))

    def mark_reading(self, index: int) -> tuple[int, int, int]:
        """(allocated now, its peak, bytes ever allocated) from one host-side allocator read:
        what a step mark records."""
        if not torch.cuda.is_initialized():
            return 0, 0, 0
        try:
            counts = torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]
            return int(counts["current"]), int(counts["peak"]), int(counts["allocated"])
        except (AttributeError, KeyError, TypeError):
            return int(torch.cuda.memory_allocated(index)), 0, 0

    def mem_get_info(self, index: int) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)

    def empty_cache(self, index: int) -> None:
        with torch.cuda.device(index):
            torch.cuda.empty_cache()

    def reset_peak(self, index: int) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def snapshot(self) -> dict[str, Any]:
        if not self._used_indices():
            return {"segments": [], "device_traces": []}
        return dict(torch.cuda.memory._snapshot())

    def record_history(self, enabled: bool) -> bool:
        """Stack recording in its cheapest form that still keeps each live block's allocating
        stack: state only (no trace ring), allocation context, Python frames.  The trainer's
        thread at a step boundary only (DESIGN §6).  False while no device is in use (nothing
        to record yet: CUDA is not initialised here for it)."""
        indices = self._used_indices()
        if not indices:
            return False
        record = torch.cuda.memory._record_memory_history
        for index in indices:
            if enabled:
                record(
                    enabled="state",
                    context="alloc",
                    stacks="python",
                    max_entries=HISTORY_MAX_ENTRIES,
                    device=index,
                )
            else:
                record(enabled=None, device=index)
        return True

    def install_step_hook(self, on_step: StepCallback) -> bool:
        if _register_step_post_hook is None:
            return False
        self.remove_step_hook()  # installing twice must not count every step twice
        # With several optimizers (a GAN, say) a training step is one step of the first one to
        # step.  It is held weakly: when it is gone (a new phase built a new optimizer), the next
        # optimizer to step takes its place, instead of steps going uncounted for good.
        first: list[weakref.ref[Any]] = []

        def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._in_optimizer_step = True

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._in_optimizer_step = False
            try:
                if optimizer not in self._optimizers:
                    with self._lock:
                        self._optimizers.add(optimizer)
                if not first or first[0]() is None:
                    first[:] = [weakref.ref(optimizer)]
                if first[0]() is optimizer:
                    on_step()
            except Exception:  # never raise into the trainer's optimizer.step()
                pass

        self._hook_handle = _register_step_post_hook(hook)
        if _register_step_pre_hook is not None:
            self._pre_hook_handle = _register_step_pre_hook(pre_hook)
        return True

    def remove_step_hook(self) -> None:
        """Undo install_step_hook (the hook is process-global in torch)."""
        handle, self._hook_handle = self._hook_handle, None
        if handle is not None:
            handle.remove()
        pre, self._pre_hook_handle = self._pre_hook_handle, None
        if pre is not None:
            pre.remove()
        self._in_optimizer_step = False

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        """Have `observer(device, alloc_size, memory limit, device free)` called by the CUDA
        caching allocator at every out-of-memory, on the allocating thread, with the allocator's
        lock released.  The allocator keeps observers per device, so they can only be attached
        once CUDA is initialised: torch's lazy-init queue runs the attach right after the
        trainer initialises CUDA (or now, if it has).  Never initialises CUDA itself."""
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if attach is None or lazy_call is None:
            return False  # a CPU build of torch: no CUDA allocator to observe

        def register() -> None:
            with contextlib.suppress(Exception):  # nothing may fail the trainer's CUDA init
                attach(observer)

        lazy_call(register)
        return True

    def current_pass(self) -> str | None:
        """The allocating thread's pass, for an OOM report: "optimizer" inside optimizer.step(),
        "backward" inside autograd's graph task (on its own device threads, too), else "forward"
        (or "no_grad" where grad mode is off: evaluation, inference)."""
        if self._in_optimizer_step:
            return "optimizer"
        task = getattr(torch._C, "_current_graph_task_id", None)
        if task is not None and task() != -1:
            return "backward"
        return "forward" if torch.is_grad_enabled() else "no_grad"

    def collected_optimizers(self) -> list[Any]:
        """The optimizers the step hook has seen step and that are still alive."""
        with self._lock:
            return list(self._optimizers)

    def breakdown_by_device(self, device_type: str = "cuda") -> dict[int, RoleBytes]:
        """count_optimizer_memory() over the collected optimizers (any device type)."""
        return count_optimizer_memory(self.collected_optimizers(), device_type)

    def breakdown(self) -> dict[int, Breakdown]:
        """Bytes of parameters, gradients and optimizer state per CUDA device, each storage once."""
        return {
            index: Breakdown(
                parameters=counts.parameters,
                gradients=counts.gradients,
                optimizer_state=counts.optimizer_state,
                allocated=self.memory_allocated(index) if index >= 0 else 0,
                fp32_parameter_bytes=counts.fp32_parameter_bytes,
            )
            for index, counts in self.breakdown_by_device(self.breakdown_device_type).items()
        }
