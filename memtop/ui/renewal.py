"""Which held figures a round shows anew (issue 35, item 8: the dashboard's bytes).

The widgets hold the figures that move every second without news (a sawtooth's allocated
bytes, host CPU and RSS, the sparklines, a suggestion's wording) and show them anew once per
slow period (render.slow_tick).  A figure a user must see at once (used, reserved, a peak, a
leak's verdict, a process come or gone) is shown the round it moves; and since the suggestions
quote both kinds ("76.3 GiB of 80.0 GiB used; pid 758 reserves 55.9 GiB (22.2 GiB cached)"),
a suggestion worded anew renews the held figures of what it names too, so one thing never
reads as two values on one screen.

The units are what a figure belongs to: a GPU's card, and a process's row.  A card or a row
renews its held figures when its own news moved.  A suggestion is worded anew when news moved
for what it may quote (its process, that process's GPU, its GPU; a host-wide one: anything)
and its words changed; a suggestion worded anew renews the card and the rows it names (its
pid's rows and its GPU's card; about a GPU and no process: every row on that GPU, which it
may quote), and what those renew may word other suggestions anew in turn.  A leak on GPU 0
thus moves the leaking process's row, GPU 0's card and the leak's words every second, and
leaves rank 0's allocated bytes on GPU 0 held: renewing every row of a GPU with news (the rule
before) rewrote rank 0's sawtooth and its job's "alloc spread" every second in the `mixed` demo,
a fifth of the bytes it sent.  Where a card prints sums of its rows' held figures (a two-line
card's "alloc 22.7G"), the card and its rows still renew together: a sum beside its parts from
another round would read as a wrong sum.  News is what reads differently on screen: a figure
compared as printed at its finest ("38.7 GiB", "47.7 %"), so that bytes moving below the print
renew nothing; a suggestion's words are compared as built (its figures already printed).
"""

from __future__ import annotations

from dataclasses import field

from memtop.base.records import record
from memtop.figures.units import format_bytes
from memtop.ui.render import slow_tick
from memtop.ui.view import Dashboard, GpuRow, ProcessRow, SuggestionItem

# A GPU as the rules above scope it: the driver's index (a fleet's GPU 0 of two hosts share one:
# renewing both where one moved costs a few bytes, never a stale figure); None for the rows of
# processes on no GPU (CPU-only trainers).
GpuScope = int | None
# A row's news: its GPU, then its used, reserved and peak as printed, and its state.
RowNews = tuple[GpuScope, str, str, str, str]


@record(frozen=True)
class Renewal:
    """This round's decision: every held figure (`everything`), or those of the cards of
    `gpus`, the rows of `pids` and the suggestions keyed in `suggestions`."""

    everything: bool
    gpus: frozenset[GpuScope] = field(default_factory=frozenset)
    pids: frozenset[int] = field(default_factory=frozenset)
    suggestions: frozenset[str] = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return self.everything or bool(self.gpus or self.pids or self.suggestions)

    def gpu(self, row: GpuRow) -> bool:
        return self.everything or row.index in self.gpus

    def process(self, row: ProcessRow) -> bool:
        return self.everything or row.pid in self.pids

    def suggestion(self, item: SuggestionItem) -> bool:
        return self.everything or item.key in self.suggestions


def _read(n: int | None) -> str:
    """A byte count as read on screen at its finest ("38.7 GiB"; the table's "38.7G" and
    the suggestions' words are no finer): a figure that moved below what is printed is no
    news, and renews nothing."""
    return format_bytes(n)


EVERYTHING = Renewal(everything=True)
NOTHING = Renewal(everything=False)


class RenewalClock:
    """Decides, once a round for every widget (MemtopApp.refresh_view), which held figures are
    shown anew: all of them once per slow period and in any round whose news is screen-wide (a
    suggestion come, gone or re-ranked; the layout); otherwise those of each card and row whose
    own news moved (a card's used, its share, reserved, peak or trend verdict; a row's used,
    reserved, peak or state; a row come or gone), each as printed, with the suggestions that
    quote them and what those name (the module's docstring)."""

    def __init__(self) -> None:
        self._tick = -1
        self._screen: tuple[object, ...] = ()
        self._cards: dict[GpuScope, tuple[object, ...]] = {}
        self._rows: dict[str, RowNews] = {}
        self._worded: dict[str, SuggestionItem] = {}  # each suggestion as last worded

    def due(self, dash: Dashboard, compact: bool, sums: bool = True) -> Renewal:
        """`sums`: whether the cards print sums of their rows' held figures (a two-line card's
        "alloc 22.7G"): then a card and the rows on its GPU renew together, or the sum and
        its parts would read as two rounds; a dense card (one line, a bar) prints none."""
        tick = slow_tick()
        screen = (compact, tuple((s.key, s.severity) for s in dash.suggestions))
        cards: dict[GpuScope, list[object]] = {}
        for g in dash.gpus:
            share = f"{100 * g.used_share:.1f}" if g.used_share is not None else None
            figures = map(_read, (g.used, g.reserved, g.peak, g.other))
            counts = (g.error, g.agents, g.processes)
            cards.setdefault(g.index, []).append(
                (g.uuid, *figures, share, g.trend.label(), *counts)
            )
        card_news = {index: tuple(items) for index, items in cards.items()}
        row_news: dict[str, RowNews] = {
            p.key: (p.gpu, _read(p.used), _read(p.reserved), _read(p.peak), p.state)
            for p in dash.processes
        }
        everything = tick != self._tick or screen != self._screen
        self._screen = screen
        moved_cards = {
            index
            for index in card_news.keys() | self._cards.keys()
            if card_news.get(index) != self._cards.get(index)
        }
        moved_rows = {
            key
            for key in row_news.keys() | self._rows.keys()
            if row_news.get(key) != self._rows.get(key)
        }
        shown_rows = self._rows
        self._cards, self._rows = card_news, row_news
        if everything:
            self._tick = tick
            self._worded = {s.key: s for s in dash.suggestions}
            return EVERYTHING
        gpus_of: dict[int, set[GpuScope]] = {}
        pids_on: dict[GpuScope, set[int]] = {}
        for p in dash.processes:
            gpus_of.setdefault(p.pid, set()).add(p.gpu)
            pids_on.setdefault(p.gpu, set()).add(p.pid)
        pid_of = {p.key: p.pid for p in dash.processes}
        gpus = set(moved_cards)
        pids = {pid_of[key] for key in moved_rows if key in pid_of}
        # A row come or gone: news for its GPU's card too (it counts the GPU's processes).
        gpus |= {row_news[key][0] for key in row_news.keys() - shown_rows.keys()}
        gpus |= {shown_rows[key][0] for key in shown_rows.keys() - row_news.keys()}
        worded: set[str] = set()
        changed = True
        while changed:  # until what is renewed words nothing more anew (a few passes at most)
            changed = False
            if sums:  # a card with its rows, both ways
                rows_of_cards = set().union(*(pids_on.get(g, set()) for g in gpus))
                cards_of_rows = set().union(*(gpus_of.get(pid, set()) for pid in pids))
                if not rows_of_cards <= pids or not cards_of_rows <= gpus:
                    pids |= rows_of_cards
                    gpus |= cards_of_rows
                    changed = True
            for item in dash.suggestions:
                if item.key in worded or not self._quotes_news(item, gpus, pids, gpus_of):
                    continue
                if item == self._worded.get(item.key):
                    continue  # the same words: nothing to renew for it
                worded.add(item.key)
                self._worded[item.key] = item
                named_gpus = set(gpus_of.get(item.pid, ())) if item.pid is not None else set()
                named_pids = {item.pid} if item.pid is not None else set()
                if item.device is not None:
                    named_gpus.add(item.device)
                    if item.pid is None:  # about the GPU: it may quote any process on it
                        named_pids |= pids_on.get(item.device, set())
                if not named_gpus <= gpus or not named_pids <= pids:
                    gpus |= named_gpus
                    pids |= named_pids
                    changed = True
        if not (gpus or pids or worded):
            return NOTHING
        return Renewal(
            everything=False,
            gpus=frozenset(gpus),
            pids=frozenset(pids),
            suggestions=frozenset(worded),
        )

    @staticmethod
    def _quotes_news(
        item: SuggestionItem,
        gpus: set[GpuScope],
        pids: set[int],
        gpus_of: dict[int, set[GpuScope]],
    ) -> bool:
        """Whether `item` may quote a figure renewed this round: its process's, that
        process's GPU's, its GPU's; a host-wide suggestion (no process, no GPU) anything."""
        if item.pid is None and item.device is None:
            return bool(gpus or pids)
        if item.device is not None and item.device in gpus:
            return True
        if item.pid is None:
            return False
        return item.pid in pids or bool(gpus_of.get(item.pid, set()) & gpus)
