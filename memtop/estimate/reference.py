"""DeepSpeed's own estimators of ZeRO model-state memory per GPU (no offload), reported beside
memtop's so a user can see both: `deepspeed.runtime.zero.stage_1_and_2.
estimate_zero2_model_states_mem_needs` and `...stage3.estimate_zero3_model_states_mem_needs`.

They count mixed-precision Adam as DeepSpeed runs it: 16-bit parameters and gradients on every
GPU (stage 2) plus 16 bytes a parameter partitioned (fp32 master weights, fp32 gradients, two
moments); stage 3 partitions 18 bytes a parameter and gathers the largest layer whole.
"""

from __future__ import annotations


def deepspeed_zero2_gpu_bytes(total_params: int, gpus: int) -> int:
    return 4 * total_params + int(16 * total_params / gpus)


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, gpus: int) -> int:
    return 4 * largest_layer_params + int(18 * total_params / gpus)
