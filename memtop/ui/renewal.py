"""Which held figures a round shows anew, GPU by GPU (issue 35, item 8: the dashboard's bytes).

The widgets hold the figures that move every second without news (a sawtooth's allocated
bytes, host CPU and RSS, the sparklines, a suggestion's wording) and show them anew once per
slow period (render.slow_tick).  A figure a user must see at once (used, reserved, a peak, a
leak's verdict, a process come or gone) is shown the round it moves; and since the suggestions
quote both kinds ("76.3 GiB of 80.0 GiB used; pid 758 reserves 55.9 GiB (22.2 GiB cached)"),
that round renews the held figures beside it too, so one thing never reads as two values on
one screen.

The unit of that rule is one GPU: its card, its processes' rows and the suggestions about it
or about a process on it.  Those are the figures a suggestion puts side by side; a leak on
GPU 0 says nothing new about rank 4's allocated bytes on GPU 4, and renewing the whole screen
for it (as one screen-wide rule did) rewrote every row's figures every second in the `mixed`
demo: 4.4× nvitop's bytes to the terminal.  What has no single GPU (a host-wide suggestion, a
job's header) follows any GPU's renewal: a suggestion is worded anew whenever a GPU it might
quote is, and a job's header is computed from the rows as shown.  News is what reads
differently on screen: a figure compared as printed at its finest ("38.7 GiB", "47.7 %"), so
that bytes moving below the print renew nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memtop.figures.units import format_bytes
from memtop.ui.render import slow_tick
from memtop.ui.view import Dashboard, GpuRow, ProcessRow, SuggestionItem

# A GPU as the rules above scope it: the driver's index (a fleet's GPU 0 of two hosts share one:
# renewing both where one moved costs a few bytes, never a stale figure); None for the rows of
# processes on no GPU (CPU-only trainers).
GpuScope = int | None


@dataclass(frozen=True)
class Renewal:
    """This round's decision: every held figure (`everything`), or those of `gpus` only."""

    everything: bool
    gpus: frozenset[GpuScope] = field(default_factory=frozenset)
    pids: frozenset[int] = field(default_factory=frozenset)  # with a row on one of `gpus`

    def __bool__(self) -> bool:
        return self.everything or bool(self.gpus)

    def gpu(self, row: GpuRow) -> bool:
        return self.everything or row.index in self.gpus

    def process(self, row: ProcessRow) -> bool:
        return self.everything or row.gpu in self.gpus

    def suggestion(self, item: SuggestionItem) -> bool:
        if self.everything:
            return True
        if item.device is None and item.pid is None:
            return bool(self.gpus)  # about no one GPU: it may quote any
        return item.device in self.gpus or item.pid in self.pids


def _read(n: int | None) -> str:
    """A byte count as read on screen at its finest ("38.7 GiB"; the table's "38.7G" and
    the suggestions' words are no finer): a figure that moved below what is printed is no
    news, and renews nothing."""
    return format_bytes(n)


EVERYTHING = Renewal(everything=True)
NOTHING = Renewal(everything=False)


class RenewalClock:
    """Decides, once a round for every widget (MemtopApp.refresh_view), which GPUs' held
    figures are shown anew: all of them once per slow period and in any round whose news is
    screen-wide (a suggestion come, gone or re-ranked; the layout); otherwise each GPU whose
    own news moved (its card's used, its share, reserved, peak or trend verdict; one of its
    processes' used, reserved, peak or state; a process come or gone on it), each as printed:
    a leak's 8 MiB a step moves "38.7 GiB" every second or so, not every round."""

    def __init__(self) -> None:
        self._tick = -1
        self._screen: tuple[object, ...] = ()
        self._per_gpu: dict[GpuScope, tuple[object, ...]] = {}

    def due(self, dash: Dashboard, compact: bool) -> Renewal:
        tick = slow_tick()
        screen = (compact, tuple((s.key, s.severity) for s in dash.suggestions))
        per_gpu: dict[GpuScope, list[object]] = {}
        for g in dash.gpus:
            share = f"{100 * g.used_share:.1f}" if g.used_share is not None else None
            figures = map(_read, (g.used, g.reserved, g.peak, g.other))
            counts = (g.error, g.agents, g.processes)
            per_gpu.setdefault(g.index, []).append(
                (g.uuid, *figures, share, g.trend.label(), *counts)
            )
        for p in dash.processes:
            per_gpu.setdefault(p.gpu, []).append(
                (p.key, *map(_read, (p.used, p.reserved, p.peak)), p.state)
            )
        news = {scope: tuple(items) for scope, items in per_gpu.items()}
        everything = tick != self._tick or screen != self._screen
        self._screen = screen
        moved = frozenset(
            scope
            for scope in news.keys() | self._per_gpu.keys()
            if news.get(scope) != self._per_gpu.get(scope)
        )
        self._per_gpu = news
        if everything:
            self._tick = tick
            return EVERYTHING
        if not moved:
            return NOTHING
        pids = frozenset(p.pid for p in dash.processes if p.gpu in moved)
        return Renewal(everything=False, gpus=moved, pids=pids)
