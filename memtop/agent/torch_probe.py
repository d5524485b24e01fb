"""The real probe: torch inside the trainer, over the accelerator's device backend.

What is the same on every accelerator lives here: the optimizer step hooks, the breakdown walk
(`count_optimizer_memory`), autograd's pass at an OOM, torch's version, the environment's
allocator options.  What an accelerator changes (devices, allocator counters, snapshot, cache,
settings, stack recording, the OOM observer) is a `DeviceBackend` of `memtop.agent.backends`,
chosen by its registry (CUDA/ROCm: `backends/cuda.py`, the only module that names torch.cuda).
With the backends, the only modules of memtop that import torch.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memtop.agent import backends
from memtop.agent.probe import (
    BackendExtras,
    Breakdown,
    DeviceBackend,
    ProbeDevice,
    StepCallback,
    allocator_conf_from_env,
    any_thread,
    interface_methods,
    trainer_thread,
)

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


# The optional methods a TorchProbe has exactly when its backend has them (current_pass is
# torch's, not the accelerator's: autograd and the optimizer hooks say it).
_BACKEND_EXTRAS = frozenset(interface_methods(BackendExtras)) - {"current_pass"}


class TorchProbe:
    """`memtop.agent.probe.Probe` over torch: torch's own side here, the device's in
    `self.backend` (the registry's choice unless given)."""

    def __init__(
        self, breakdown_device_type: str | None = None, backend: DeviceBackend | None = None
    ) -> None:
        self.backend = backend if backend is not None else backends.select()
        # Which tensors the breakdown counts: the backend's, unless told otherwise (the CPU soak
        # and tests set MEMTOP_BREAKDOWN_DEVICE=cpu to exercise the walk with no GPU).
        self.breakdown_device_type = (
            breakdown_device_type
            or os.environ.get("MEMTOP_BREAKDOWN_DEVICE")
            or self.backend.tensor_device_type
        )
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._hook_handle: Any = None
        self._pre_hook_handle: Any = None
        self._in_optimizer_step = False  # between the step pre- and post-hooks: the OOM's pass
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # BackendExtras' methods are the backend's, where it has them; a probe whose backend
        # lacks one lacks it too (callers ask with getattr(probe, name, None)).
        backend = self.__dict__.get("backend")
        if name in _BACKEND_EXTRAS and backend is not None:
            return getattr(backend, name)
        raise AttributeError(name)

    # ------------------------------------------------------------ torch's own
    @any_thread
    def torch_version(self) -> str | None:
        return str(torch.__version__)

    @any_thread
    def allocator_conf(self) -> str:
        return allocator_conf_from_env(os.environ)

    # ------------------------------------------------------------ the device backend's
    @any_thread
    def devices(self) -> list[ProbeDevice]:
        return self.backend.devices()

    @any_thread
    def memory_stats(self, index: int) -> dict[str, int]:
        return self.backend.memory_stats(index)

    @any_thread
    def memory_allocated(self, index: int) -> int:
        return self.backend.memory_allocated(index)

    @any_thread
    def reset_peak(self, index: int) -> None:
        self.backend.reset_peak(index)

    @trainer_thread
    def is_capturing(self) -> bool:
        return self.backend.is_capturing()

    @trainer_thread
    def mem_get_info(self, index: int) -> tuple[int, int]:
        return self.backend.mem_get_info(index)

    @trainer_thread
    def empty_cache(self, index: int) -> None:
        self.backend.empty_cache(index)

    @trainer_thread
    def snapshot(self) -> dict[str, Any]:
        return self.backend.snapshot()

    # ------------------------------------------------------------ steps, breakdown, pass
    @any_thread
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

    @any_thread
    def remove_step_hook(self) -> None:
        """Undo install_step_hook (the hook is process-global in torch)."""
        handle, self._hook_handle = self._hook_handle, None
        if handle is not None:
            handle.remove()
        pre, self._pre_hook_handle = self._pre_hook_handle, None
        if pre is not None:
            pre.remove()
        self._in_optimizer_step = False

    @any_thread
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

    @trainer_thread
    def breakdown(self) -> dict[int, Breakdown]:
        """Bytes of parameters, gradients and optimizer state per device of the backend's type,
        each storage once."""
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
