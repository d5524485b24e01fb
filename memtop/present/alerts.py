"""Told without Prometheus (issue 33.5): `--on-alert CMD` runs CMD once for each suggestion that
reaches a chosen severity, with the suggestion as JSON on its stdin.

- One run per episode: a suggestion (rule, pid, GPU) fires when it first reaches the severity,
  and again only after it has been gone for `clear_after_s` (the suggestions pane keeps an item
  at least a minute already; this is the alert's own hysteresis on top, so a verdict that blinks
  at the edge does not page twice).
- Never in the sampler's way: `observe` (called where each observation is built) only compares
  keys and queues; one worker thread runs the commands, one at a time, each bounded by
  `timeout_s` and killed past it.  A full queue drops the alert and says so.
- One line for each run: what ran, for which suggestion, its exit code and time.

The command is the invoking user's own string, run by their shell (as a git hook or cron line
is): memtop adds nothing from an agent to it; agent text reaches it only as JSON on stdin.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from memtop.engine.observation import Observation
from memtop.model import Severity

CLEAR_AFTER_S = 120.0
TIMEOUT_S = 30.0
QUEUE_MAX = 64

Key = tuple[str, int | None, int | None]


class AlertRunner:
    def __init__(
        self,
        command: str,
        severity: Severity = Severity.CRITICAL,
        *,
        log: Callable[[str], None],
        scope: Callable[[Observation], Observation] | None = None,
        clear_after_s: float = CLEAR_AFTER_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.command = command
        self.severity = severity
        self.log = log
        self.scope = scope
        self.clear_after_s = clear_after_s
        self.timeout_s = timeout_s
        self.fired = 0
        self.runs: list[tuple[Key, int | None]] = []  # (suggestion, exit code): for tests
        self._last_seen: dict[Key, float] = {}  # an episode lives while its key is seen
        self._lock = threading.Lock()
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_MAX)
        self._worker = threading.Thread(target=self._run, name="memtop-alerts", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ where observations are built

    def observe(self, observation: Observation) -> None:
        """Queue a run for each suggestion whose episode starts now.  O(suggestions); never
        blocks and never raises into its caller (a sampler's or the UI's thread)."""
        try:
            self._observe(observation)
        except Exception as exc:  # an alert must not take the dashboard down
            self.log(f"alert: {type(exc).__name__}: {exc}")

    def _observe(self, observation: Observation) -> None:
        seen = self.scope(observation) if self.scope is not None else observation
        now = observation.time
        argv = {agent.pid: list(agent.argv) for agent in seen.agents}
        with self._lock:
            for suggestion in seen.suggestions:
                if Severity(suggestion.severity).rank < self.severity.rank:
                    continue
                key: Key = suggestion.key
                last = self._last_seen.get(key)
                self._last_seen[key] = now
                if last is not None and now - last < self.clear_after_s:
                    continue  # the same episode
                payload = {
                    "host": seen.host,
                    "time": now,
                    "suggestion": suggestion.as_dict(),
                    "argv": argv.get(suggestion.pid) if suggestion.pid is not None else None,
                }
                try:
                    self._queue.put_nowait(payload)
                    self.fired += 1
                except queue.Full:
                    self.log(f"alert: dropped ({QUEUE_MAX} runs waiting): {_what(payload)}")
            # Forget episodes long over (a bounded dict under churn of pids).
            for key, last in list(self._last_seen.items()):
                if now - last >= self.clear_after_s:
                    del self._last_seen[key]

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        while (payload := self._queue.get()) is not None:
            what = _what(payload)
            started = time.monotonic()
            code: int | None
            try:
                done = subprocess.run(
                    self.command,
                    shell=True,
                    input=json.dumps(payload) + "\n",
                    text=True,
                    capture_output=True,
                    timeout=self.timeout_s,
                    start_new_session=True,  # a Ctrl-C meant for memtop is not the hook's
                )
                code = done.returncode
                took = time.monotonic() - started
                tail = (done.stderr or "").strip().splitlines()[-1:] if code else []
                said = f": {tail[0][:120]}" if tail else ""
                self.log(f"alert: ran for {what}: exit {code} in {took:.1f} s{said}")
            except subprocess.TimeoutExpired:
                code = None
                self.log(f"alert: for {what}: killed after {self.timeout_s:g} s")
            except OSError as exc:
                code = None
                self.log(f"alert: for {what}: could not run: {exc}")
            self.runs.append((_key(payload), code))

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the worker after the runs already queued (waits at most `wait_s`)."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        self._worker.join(wait_s)


def _key(payload: dict[str, Any]) -> Key:
    s = payload["suggestion"]
    return (s["rule"], s["pid"], s["device"])


def _what(payload: dict[str, Any]) -> str:
    s = payload["suggestion"]
    where = "" if s["pid"] is None else f" pid {s['pid']}"
    where += "" if s["device"] is None else f" GPU {s['device']}"
    return f"{s['rule']}{where} ({s['severity']})"
