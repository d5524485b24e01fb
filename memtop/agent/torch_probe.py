"""The real probe: torch.cuda inside the trainer.  The only module of memtop that imports torch.

Rules it keeps:
- it never initialises CUDA: until the trainer has initialised it, there are no devices;
- it only reads devices the trainer has a context on, so it creates no context elsewhere;
- every call is wrapped by the agent, which turns any exception into an error frame.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from memtop.agent.probe import Breakdown, ProbeDevice, StepCallback

_register_step_post_hook: Callable[..., Any] | None
try:
    # `torch.optim.optimizer` is not an attribute of `torch.optim` (its __init__ deletes the
    # submodule names), so the hook must be imported from the module itself.
    from torch.optim.optimizer import register_optimizer_step_post_hook as _register_step_post_hook
except ImportError:  # torch < 2.0
    _register_step_post_hook = None


def _allocator_conf() -> str:
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""


class TorchProbe:
    def __init__(self) -> None:
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._device_cache: dict[int, ProbeDevice] = {}
        self._hook_handle: Any = None
        self._lock = threading.Lock()

    def torch_version(self) -> str | None:
        return str(torch.__version__)

    def allocator_conf(self) -> str:
        return _allocator_conf()

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
                uuid = str(getattr(props, "uuid", "") or "")
                if uuid and not uuid.startswith(("GPU-", "MIG-")):
                    uuid = f"GPU-{uuid}"
                device = ProbeDevice(index, uuid, str(props.name), int(props.total_memory))
                self._device_cache[index] = device
            found.append(device)
        return found

    def memory_stats(self, index: int) -> dict[str, int]:
        return {k: int(v) for k, v in torch.cuda.memory_stats(index).items()}

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

    def install_step_hook(self, on_step: StepCallback) -> bool:
        if _register_step_post_hook is None:
            return False
        self.remove_step_hook()  # installing twice must not count every step twice
        # With several optimizers (a GAN, say) a training step is one step of the first one to
        # step.  It is held weakly: when it is gone (a new phase built a new optimizer), the next
        # optimizer to step takes its place, instead of steps going uncounted for good.
        first: list[weakref.ref[Any]] = []

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
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
        return True

    def remove_step_hook(self) -> None:
        """Undo install_step_hook (the hook is process-global in torch)."""
        handle, self._hook_handle = self._hook_handle, None
        if handle is not None:
            handle.remove()

    def breakdown(self) -> dict[int, Breakdown]:
        """Bytes of parameters, gradients and optimizer state per device, each storage once."""
        seen: set[tuple[int, int]] = set()
        totals: dict[int, dict[str, int]] = {}

        def add(tensor: Any, role: str) -> None:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
                return
            storage = tensor.untyped_storage()
            key = (tensor.device.index or 0, storage.data_ptr())
            if key in seen:
                return
            seen.add(key)
            bucket = totals.setdefault(key[0], {})
            bucket[role] = bucket.get(role, 0) + storage.nbytes()
            if role == "parameters" and tensor.dtype == torch.float32:
                bucket["fp32"] = bucket.get("fp32", 0) + storage.nbytes()

        with self._lock:
            optimizers = list(self._optimizers)
        for optimizer in optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for p in params:
                add(p, "parameters")
            for p in params:
                add(p.grad, "gradients")
            for state in list(optimizer.state.values()):
                if isinstance(state, dict):
                    for value in list(state.values()):
                        add(value, "optimizer_state")
        result = {}
        for index, bucket in totals.items():
            result[index] = Breakdown(
                parameters=bucket.get("parameters", 0),
                gradients=bucket.get("gradients", 0),
                optimizer_state=bucket.get("optimizer_state", 0),
                allocated=self.memory_allocated(index),
                fp32_parameter_bytes=bucket.get("fp32", 0),
            )
        return result
