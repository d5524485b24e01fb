"""A trainer's thread for agent tests: calls `agent.on_step()` in a loop, as a training loop
would, and remembers what it was doing when, so tests can check what ran where."""

from __future__ import annotations

import threading
import time
from typing import Any


class Stepper:
    """Steps `agent` every `period` seconds on its own thread (the "trainer's thread").

    `in_step` is True while the simulated step's own work runs and False only at the boundary,
    inside `on_step`; a probe call seen with `in_step` False happened between two steps.
    """

    def __init__(self, agent: Any, period: float = 0.01, work: Any = None) -> None:
        self.agent = agent
        self.period = period
        self.work = work
        self.in_step = False
        self.steps = 0
        self.ident: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)

    def _run(self) -> None:
        self.ident = threading.get_ident()
        while not self._stop.is_set():
            self.in_step = True
            if self.work is not None:
                self.work(self.steps)
            time.sleep(self.period)
            self.in_step = False
            self.steps += 1
            self.agent.on_step(explicit=True)

    def __enter__(self) -> Stepper:
        self._thread.start()
        deadline = time.monotonic() + 5
        while self.steps == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
