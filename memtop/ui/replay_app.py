"""The dashboard on a recording: the live app, with a time cursor instead of actions.

space pauses, ←/→ seek 10 s (shift: 60 s), [ / ] halve / double the speed, home / end jump to
the start / end.  Actions that would reach a process (cleanup, snapshot, kill, …) are not
offered: there is none.
"""

from __future__ import annotations

from typing import Any

from memtop.engine.feed import PlaybackFeed
from memtop.ui import actions
from memtop.ui.app import MemtopApp

SEEK_S = 10.0
BIG_SEEK_S = 60.0


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(max(0, int(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class ReplayApp(MemtopApp, inherit_bindings=False):
    # Textual merges the BINDINGS of every base class unless told not to: the keys that act on
    # a process, or need a live feed, must not come back from MemtopApp.  Its own keys first:
    # at 80 columns the footer shows them all, then the shared ones (memtop.ui.actions).
    ACTIONS = actions.on_replay(MemtopApp.ACTIONS)

    def __init__(
        self, store: object, player: PlaybackFeed, recording: object, **kwargs: Any
    ) -> None:
        # The player (memtop.engine.playback.Player) is the feed and holds the recording
        # (`recording` is
        # the player's, taken for the callers that name it).
        super().__init__(store, player, clock=player.clock, **kwargs)
        self.player = player
        self.recording = player.recording
        self._settled_at: float | None = None  # the cursor of the still moment on screen

    def _badges(self) -> list[tuple[str, str]]:
        # The live app's PAUSED says "p resumes"; here space plays and pauses, and the clock
        # says it.
        player = self.player
        state = "PAUSED" if player.paused else ("END" if player.at_end else "▶")
        return [
            (
                f"  REPLAY {_clock_text(player.offset)} / {_clock_text(self.recording.duration)}"
                f" ×{player.speed:g} {state} ",
                "bold black on magenta",
            )
        ]

    def refresh_view(self, exact: bool = False) -> None:
        player = self.player
        if player.still and self._settled_at != player.cursor:
            self._settle()  # paused, or the end reached: show this moment as it is
            return
        if not player.still:
            self._settled_at = None
        super().refresh_view(exact)
        # The cursor moves even where nothing was recorded: keep the header's clock true.
        if self._mounted and self.dashboard is not None:
            self._set(self.header_bar, self._header(self.dashboard))

    def _settle(self) -> None:
        """Show the cursor's moment exactly as `memtop replay FILE --once --at T` reports it:
        judged afresh at T (nothing carried from the moment the cursor left: a seek jumps over
        the rounds between) and drawn with no figure held from an earlier round."""
        self._settled_at = self.player.cursor
        self.observer.forget()
        self._generation = -1
        super().refresh_view(exact=True)
        if self._mounted and self.dashboard is not None:
            self._set(self.header_bar, self._header(self.dashboard))

    def action_toggle_play(self) -> None:
        self.player.pause(not self.player.paused)
        self.refresh_view()

    def action_seek(self, direction: int) -> None:
        self.player.step_by(direction * SEEK_S)
        self._settle()

    def action_speed(self, up: int) -> None:
        speed = self.player.faster(bool(up))
        self.notify(f"speed ×{speed:g}", timeout=1.5)
        self.refresh_view()
