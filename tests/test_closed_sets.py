"""Closed sets are enums (issue 22.2) whose members are the very strings the JSON report, the
wire and recordings always carried: `--once --json` does not change by a byte, and the CLI
offers the simulator's own list of scenarios."""

from __future__ import annotations

import argparse
import json
from enum import Enum
from typing import Any

from helpers.observations import frozen_observation

from memtop import cli
from memtop.diagnosis.leak import LeakBasis
from memtop.diagnosis.suggestions import EffectKind, RuleId
from memtop.model import (
    SOURCE_AGENT,
    SOURCE_AMDSMI,
    SOURCE_NVML,
    SOURCE_SIM,
    AgentStatus,
    Severity,
    SourceKind,
)
from memtop.present.report import build as build_report
from memtop.sim.scenario_names import DEMO_SCENARIOS, TRAINER_SCENARIOS, Scenario
from memtop.sim.scenarios import SCENARIOS
from memtop.ui.view import ProcessState, TrendStatus


def plain(value: Any) -> Any:
    """`value` with every enum member replaced by the plain string it stands for."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def enums_in(value: Any) -> set[type]:
    if isinstance(value, Enum):
        return {type(value)}
    if isinstance(value, dict):
        return set().union(*(enums_in(k) | enums_in(v) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return set().union(*(enums_in(v) for v in value))
    return set()


def test_the_json_report_is_byte_for_byte_what_plain_strings_give():
    report = build_report(frozen_observation())
    # The report does carry enum members (so this test is not vacuous) ...
    assert {RuleId, SourceKind, LeakBasis} <= enums_in(report)
    # ... and they serialise exactly as the strings did.
    assert json.dumps(report) == json.dumps(plain(report))
    assert json.dumps(report, indent=1, sort_keys=True) == json.dumps(
        plain(report), indent=1, sort_keys=True
    )
    assert {d["source"] for d in report["devices"]} == {"nvml"}


def test_every_closed_set_reads_and_prints_as_its_words():
    for choices in (
        SourceKind,
        AgentStatus,
        Severity,
        LeakBasis,
        RuleId,
        EffectKind,
        Scenario,
        ProcessState,
        TrendStatus,
    ):
        for member in choices:  # type: ignore[attr-defined]
            word = member.value
            assert member == word and hash(member) == hash(word)
            assert str(member) == f"{member}" == f"{member:<1}" == word
            assert json.dumps({member: member}) == json.dumps({word: word})
            assert choices(word) is member
    # The names other modules import are the members.
    assert tuple(SourceKind) == (SOURCE_NVML, SOURCE_AMDSMI, SOURCE_SIM, SOURCE_AGENT)


def test_the_cli_offers_the_simulators_scenarios():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    demo = sub.choices["demo"]
    scenario = next(a for a in demo._actions if a.dest == "scenario")
    assert scenario.choices is DEMO_SCENARIOS
    assert SCENARIOS is TRAINER_SCENARIOS
    assert (*TRAINER_SCENARIOS, "mixed") == DEMO_SCENARIOS
    assert DEMO_SCENARIOS == (
        "healthy",
        "leak",
        "fragment",
        "pressure",
        "oom",
        "server",
        "server-overrun",
        "mixed",
    )
