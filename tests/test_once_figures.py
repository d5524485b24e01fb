"""One page, one figure for one thing (issue 36, item 18): `--once` text showed the
instantaneous fragmentation in the table and the smoothed one in its suggestion; the breakdown
said neither the step it was measured after nor how old it was (it lagged a minute behind in
one run)."""

from __future__ import annotations

from helpers.observations import frozen_observer
from ui_frozen import NOW, frozen_store

from memtop import protocol
from memtop.figures.units import GiB
from memtop.present import report

FRAGMENTED = 4201  # the frozen store's fragmenting trainer


def test_the_table_shows_the_fragmentation_its_suggestion_judges() -> None:
    data = report.build(frozen_observer().latest())
    (agent,) = [a for a in data["agents"] if a["pid"] == FRAGMENTED]
    (device,) = agent["devices"]
    smoothed = device["fragmentation_smoothed"]
    (found,) = [s for s in data["suggestions"] if s["rule"] == "expandable_segments"]
    assert f"{smoothed:.2f}" in found["title"]
    device["fragmentation"] = 0.05  # an instant of the step unlike the recent median
    text = report.render_text(data)
    (row,) = [line for line in text.splitlines() if line.startswith(str(FRAGMENTED))]
    assert f" {smoothed:.2f} " in row and " 0.05 " not in row, row
    assert "frag~: the median of the recent fragmentation samples" in text


def test_the_breakdown_says_its_step_and_age() -> None:
    store = frozen_store()
    parts = {"parameters": 3 * GiB, "gradients": 3 * GiB, "optimizer_state": 6 * GiB,
             "other": 2 * GiB}  # fmt: skip
    reply = {"time": NOW - 30.0, "step": 590, "devices": {"0": parts}}
    store.update_breakdown(4101, protocol.parse_breakdown(reply), when=NOW - 29.5)
    data = report.build(frozen_observer(store).latest())
    (agent,) = [a for a in data["agents"] if a["pid"] == 4101]
    (device,) = agent["devices"]
    assert device["breakdown_step"] == 590 and device["breakdown_age_s"] == 30.0
    text = report.render_text(data)
    assert (
        "breakdown at step 590, 30 s ago: parameters 3.0 GiB, gradients 3.0 GiB, "
        "optimizer state 6.0 GiB, other 2.0 GiB" in text
    ), text
