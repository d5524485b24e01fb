"""Frozen observations: the dashboard's frozen store (tests/ui_frozen.py) observed once, with a
fixed clock, host and uid, so view-model and report tests need no terminal and no sampler."""

from __future__ import annotations

from typing import Any

from ui_frozen import MY_UID, NOW, frozen_store

from memtop.engine.observation import Observation, Observer
from memtop.engine.store import Store

HOST = "gpu-box"


def frozen_observer(store: Store | None = None, **store_options: Any) -> Observer:
    store = store if store is not None else frozen_store(**store_options)
    return Observer(store, clock=lambda: NOW, host=HOST, uid=MY_UID)


def frozen_observation(**store_options: Any) -> Observation:
    return frozen_observer(**store_options).latest()
