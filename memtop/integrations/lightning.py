"""`MemtopCallback` for Lightning's `Trainer` (`lightning` or the older `pytorch_lightning`).

    from memtop.integrations.lightning import MemtopCallback
    trainer = L.Trainer(callbacks=[MemtopCallback()])

Every hook runs on the trainer's thread and does O(1) work.  `trainer.global_step` counts
optimizer updates (gradient accumulation included), so it is memtop's step number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]

import memtop
from memtop.integrations import start


class MemtopCallback(Callback):  # type: ignore[misc]
    def __init__(self, socket_dir: str | Path | None = None, quiet: bool = True) -> None:
        super().__init__()
        self.socket_dir = socket_dir
        self.quiet = quiet
        self._fitting = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        start(self.socket_dir, self.quiet)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        start(self.socket_dir, self.quiet)
        self._fitting = True
        memtop.phase("train")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        memtop.phase("train")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        # Called for every batch; the step moves only when an optimizer update happened.
        memtop.sync_step(trainer.global_step)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        memtop.phase("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        memtop.phase("train" if self._fitting else "idle")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        memtop.phase("eval")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        memtop.phase("idle")

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        memtop.phase("predict")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        memtop.phase("idle")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        # Called while the checkpoint is being built, before it is written; the next batch
        # (or validation's end) sets the phase back.
        memtop.phase("save")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._fitting = False
        memtop.sync_step(trainer.global_step)
        memtop.phase("idle")
