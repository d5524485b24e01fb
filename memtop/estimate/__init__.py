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

The package imports none of its parts: each is imported by its own name
(`memtop.estimate.memory.estimate`, `memtop.estimate.architecture.PRESETS`), so that the
dashboard's diagnosis, which takes `calibrate.BatchModel` (the model of a step that `estimate
--from` calibrates), does not load the estimator's tables with it (~1 MB and ~15 ms of its start).

Outside the layers on purpose (one package on two levels; see pyproject's contract): its arithmetic
imports no I/O, and only its command reads the local GPU.
"""
