"""The suggestions users read and scripts parse are contracts (DESIGN §7): on fixed facts and on
the dashboard's frozen observation, every rule's JSON entry and the pane's words (title, effect,
its colour, the folded tips line) come out exactly as pinned in
tests/data/suggestion_contract.json.  A rule's wording may change on purpose: then regenerate
the file with `MEMTOP_PIN_SUGGESTIONS=1 python -m pytest tests/test_suggestion_contract.py` and
read its diff."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from helpers.observations import frozen_observation
from test_suggestions import BREAKDOWN, TOTAL, GiB, MiB, device, frag, gpu, leak, told

from memtop.diagnosis import suggestions as rules
from memtop.diagnosis.fragmentation import Pressure
from memtop.model import Severity
from memtop.present.report import build as build_report
from memtop.ui import view

PINNED = Path(__file__).parent / "data" / "suggestion_contract.json"


def facts() -> dict[str, Any]:
    """One GPU per story, together firing every rule at least once."""
    hog = device(pid=200, allocated=10 * GiB, reserved=30 * GiB)
    short = device(pid=300, pressure=Pressure(4, 0, 4, 0, 600.0))
    oom_report = {
        "step": 41,
        "phase": "backward",
        "path": "/runs/oom.json",
        "diagnosis": {"cause": "fragmentation", "detail": "split", "fix": "X=1"},
    }
    rank = dataclasses.replace(
        device(pid=400, peak=40 * GiB),
        rank=3,
        job="job-7",
        peer_ranks=3,
        peers_median_peak_bytes=30 * GiB,
    )
    return {
        "busy": gpu(
            device(breakdown=BREAKDOWN, leak=leak(1200), fragmentation=frag(0.3, 2 * GiB)),
            used=int(0.96 * TOTAL),
        ),
        "neighbours": gpu(hog, short, used=int(0.93 * TOTAL)),
        "checkpointing": gpu(
            device(
                peak=70 * GiB,
                breakdown=dict(BREAKDOWN, parameters=4 * GiB, optimizer_state=8 * GiB),
            ),
            used=int(0.9 * TOTAL),
        ),
        "roomy": gpu(
            device(allocated=10 * GiB, reserved=16 * GiB, peak=14 * GiB, baseline=10 * GiB),
            used=17 * GiB,
        ),
        "oom": gpu(
            told(
                device(pressure=Pressure(9, 2, 3, 1, 600.0), conf="max_split_size_mb:64"),
                hip="6.2",
                last_oom=oom_report,
            ),
            device(pid=101, pressure=Pressure(5, 2, 1, 1, 600.0)),
        ),
        "rank": gpu(rank),
        "oom_growth": gpu(
            dataclasses.replace(
                device(pressure=Pressure(2, 1, 2, 1, 600.0)),
                oom_growth={"detail": "the batch doubles", "fix": "cap the batch"},
            )
        ),
        "tips": gpu(
            device(
                allocated=10 * GiB,
                reserved=16 * GiB,
                peak=40 * GiB,
                baseline=10 * GiB,
                breakdown=BREAKDOWN,
            ),
            used=17 * GiB,
        ),
        "leak_in_time": gpu(
            device(
                leak=dataclasses.replace(
                    leak(None), bytes_per_step=None, basis="time", since=None, steps_to_full=None
                )
            )
        ),
    }


def item(i: view.SuggestionItem) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Severity) else v for k, v in dataclasses.asdict(i).items()}


def observed() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, gpu_facts in facts().items():
        suggested = rules.suggest([gpu_facts])
        found[name] = {
            "json": [s.as_dict() for s in suggested],
            "pane": [item(i) for i in view.suggestion_items(suggested, True)],
            "one_by_one": [item(view.suggestion_item(s)) for s in suggested],
        }
    obs = frozen_observation()
    found["frozen"] = {
        "json": json.loads(json.dumps(build_report(obs)))["suggestions"],
        "pane": [item(i) for i in view.build(obs).suggestions],
    }
    return found


def test_suggestions_read_as_pinned():
    found = json.loads(json.dumps(observed()))
    if os.environ.get("MEMTOP_PIN_SUGGESTIONS"):
        PINNED.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(PINNED.read_text())
    for story in pinned:
        assert found[story] == pinned[story], story
    assert found.keys() == pinned.keys()
    # Every rule speaks at least once here, so a rule's words cannot drift unseen.
    spoken = {s["rule"] for story in found.values() for s in story["json"] if "rule" in s}
    assert spoken >= {"usage", "oom", "leak", "rank_drift", "expandable_segments", "cleanup"}
    assert spoken >= {"gradient_checkpointing", "8bit_optimizer", "bf16_parameters"}
    assert "bigger_batch" in spoken
    assert any(i["rule"] == "tips" for story in found.values() for i in story["pane"])
    assert MiB  # (the helpers' units, imported for the stories above)


def test_the_view_says_a_rule_in_its_records_words(monkeypatch):
    # One home per rule: changing a rule's record is all it takes to change how the pane says
    # it (no table keyed by rule strings in the view).
    reworded = dataclasses.replace(
        rules.leak, effect_words="grows {} an hour", short_title="the leak", effect_kind="room"
    )
    monkeypatch.setitem(rules.RULES_BY_ID, "leak", reworded)
    (found,) = rules.suggest([gpu(device(leak=leak(86_400)))])
    shown = view.suggestion_item(found)
    assert shown.effect == "grows 281.2 GiB an hour"
    assert shown.effect_kind == "room"
    assert found.short_title == "the leak"
