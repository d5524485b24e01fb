"""The simulator simulates what it did before it was made faster, decision for decision.

Each case runs a workload (every trainer scenario and both servers, under five allocator
settings, on a local GPU and on a shared GPU's ledger) or a random program of mallocs and frees
on two streams, and digests, step by step, everything an observer reads: the statistics at every
pause and step end, the snapshot's segments and blocks, the device's reserves, releases and
ledger, the OOM messages and the breakdown (tests/sim_transcripts.py).  The digests are pinned
(tests/data/sim_transcripts.json, made by the simulator before its hot path was rewritten): a
change in any block, split, merge, segment, address or figure changes a digest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_transcripts import PINNED, cases

CASES = dict(cases())


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_simulation_is_the_pinned_one_step_for_step(name: str, tmp_path: Path) -> None:
    pinned = json.loads(PINNED.read_text())[name]
    made = CASES[name](tmp_path)
    first = next((i for i, (a, b) in enumerate(zip(made, pinned, strict=False)) if a != b), None)
    assert first is None and len(made) == len(pinned), (
        f"{name}: the transcript departs from the pinned one at digest {first} of {len(pinned)}"
        f" (made {len(made)}); see tests/sim_transcripts.py"
    )


def test_every_pinned_transcript_is_a_case() -> None:
    assert sorted(json.loads(PINNED.read_text())) == sorted(CASES)
