"""`memtop estimate`: will a training run fit, before it starts.

Pure arithmetic over a model's architecture and the training setup; imports neither torch nor
anything that does I/O except `architecture.load_hf_config` (one local JSON file).  The parts:

- architecture.py   the model: presets with the real numbers, a local HF `config.json`, or a
                    parameter count with an assumed shape; parameter counts per tensor;
- memory.py         bytes per GPU: weights, gradients, optimizer state, activations (Korthikanti
                    et al. 2022), CUDA context and workspace; LoRA/QLoRA, ZeRO, checkpointing;
                    the largest batch that fits;
- gpus.py           the capacities of named GPUs;
- reference.py      DeepSpeed's own ZeRO estimators, reported beside ours;
- render.py         the table and the JSON object.

Outside the layers on purpose (one package on two levels; see pyproject's contract): its arithmetic
imports no I/O, and only its command reads the local GPU.
"""

from memtop.estimate.architecture import PRESETS, Architecture, assumed_shape, load_hf_config
from memtop.estimate.memory import Estimate, Setup, estimate, max_batch

__all__ = [
    "PRESETS",
    "Architecture",
    "Estimate",
    "Setup",
    "assumed_shape",
    "estimate",
    "load_hf_config",
    "max_batch",
]
