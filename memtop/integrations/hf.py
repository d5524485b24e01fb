"""`MemtopCallback` for the transformers `Trainer`.

    from memtop.integrations.hf import MemtopCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[MemtopCallback()])

Every hook runs on the trainer's thread and does O(1) work: an attribute write or two.  The
Trainer has no hook before it evaluates or saves, but it decides both in `on_step_end`
(`control.should_evaluate`, `control.should_save`, set by its DefaultFlowCallback, which runs
before user callbacks) and acts right after the callbacks return: that is where the phase
changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

import memtop
from memtop.integrations import start


class MemtopCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, socket_dir: str | Path | None = None, quiet: bool = True) -> None:
        self.socket_dir = socket_dir
        self.quiet = quiet

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        start(self.socket_dir, self.quiet)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        start(self.socket_dir, self.quiet)
        memtop.phase("train")
        if state.global_step:
            memtop.sync_step(state.global_step)  # resumed from a checkpoint

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        memtop.phase("train")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Once per optimizer update (the Trainer calls on_substep_end for accumulation steps).
        memtop.sync_step(state.global_step)
        if getattr(control, "should_evaluate", False):
            memtop.phase("eval")
        elif getattr(control, "should_save", False):
            memtop.phase("save")

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        memtop.phase("eval")  # also covers trainer.evaluate() / predict() called directly

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        memtop.phase("save" if getattr(control, "should_save", False) else "train")

    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        memtop.phase("train")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        memtop.phase("train")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        memtop.sync_step(state.global_step)
        memtop.phase("idle")
