"""Issue 21: what the dashboard says is true at every moment (frozen data, the real app under
Textual's pilot): sort arrows, the suggestions' focus, read-only mode, filters, wording."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from test_cli import leak_demo, memtop  # noqa: F401 (a fixture)
from test_ui_frozen import frozen_app
from test_ui_nvitop import drive, pids
from ui_frozen import (
    MY_UID,
    NOW,
    SECONDS,
    T0,
    TOTAL,
    TRAINERS,
    frozen_store,
    nvml_at,
    poll_at,
)
from ui_helpers import notifications, screen_text, wait_for

from memtop import cli
from memtop.engine.observation import Observer
from memtop.engine.scope import Scope
from memtop.engine.store import Store
from memtop.model import AgentHello, AgentSample, DriverReading
from memtop.sources.agents import CONNECTED, AgentView
from memtop.sources.processes import ProcessInfo
from memtop.ui import config, view
from memtop.ui.app import MemtopApp
from memtop.ui.screens.confirm import ConfirmScreen
from memtop.ui.screens.detail import DetailScreen
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane


def test_sort_arrow_says_the_order_not_the_inversion() -> None:
    # PID sorts ascending by nature: it showed "PID▼" beside "USED▼" meaning descending.
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        await pilot.press("greater_than_sign")
        assert table.sort_key == "pid" and pids(app) == sorted(pids(app))
        await pilot.pause()
        screen = screen_text(app.export_screenshot())
        assert "PID▲" in screen and "sort pid ▲" in screen
        await pilot.press("I")
        await pilot.pause()
        screen = screen_text(app.export_screenshot())
        assert pids(app) == sorted(pids(app), reverse=True)
        assert "PID▼" in screen and "sort pid ▼" in screen

    drive(frozen_app(), body)


def test_tab_to_suggestions_highlights_the_first_and_enter_opens_it() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        pane = app.query_one(SuggestionsPane)
        await pilot.press("tab")
        assert app.focused is pane
        assert pane.highlighted == 0 and pane.selected() is pane.items[0]
        first = pane.items[0]
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert isinstance(app.screen, DetailScreen)
        assert app.screen.row.pid == first.pid  # type: ignore[attr-defined]

    drive(frozen_app(), body)


NO_DRIVER = "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"


def cpu_only_store(steps: int = 689) -> Store:
    """A machine without an NVIDIA driver and one CPU-only trainer under `memtop run`."""
    store = Store()
    hello = AgentHello(1, 5150, ("train_cpu.py",), "3.12.3", "2.13.0", "", ())
    for t in range(5):
        store.update_driver(DriverReading(available=False, error=NO_DRIVER), T0 + t)
        sample = AgentSample(time=T0 + t, step=steps - 4 + t, devices=())
        store.update_agents([AgentView(5150, CONNECTED, hello, sample)], T0 + t + 0.01)
    store.update_processes(
        {5150: ProcessInfo(5150, MY_UID, "ada", ("python", "train_cpu.py"), "python")}
    )
    return store


def test_gpu_pane_says_once_why_there_is_no_gpu() -> None:
    # Without NVML the GPU pane said "Reading devices and agents…" forever, and the status line
    # "NVML: NVML not available…".
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        assert "Reading devices" not in screen
        assert "No GPU visible. NVML not available" in screen
        assert screen.count("NVML not available") == 1 and "NVML: NVML" not in screen
        assert "5150" in screen  # the agent still shows

    drive(frozen_app(cpu_only_store()), body)


def test_cpu_only_trainer_is_not_called_healthy() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        assert "looks healthy" not in screen and "use no GPU (CPU only)" in screen

    drive(frozen_app(cpu_only_store()), body)


def test_detail_of_a_cpu_only_trainer_says_its_agent_is_there() -> None:
    # The breakdown box said "No agent in this process" under a title "agent · step 689".
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
        await pilot.pause(0.2)
        screen = screen_text(app.export_screenshot())
        assert "agent · step 689" in screen
        assert "No agent" not in screen and "No memtop agent" not in screen
        assert "The agent is running" in screen and "CPU only" in screen
        assert "No CUDA device (CPU only): judged by its host memory" in screen

    drive(frozen_app(cpu_only_store()), body)


def test_detail_says_whether_the_breakdown_was_measured() -> None:
    from memtop.ui.screens.detail import _breakdown

    obs = Observer(frozen_store(), clock=lambda: NOW, uid=MY_UID).latest()
    dash = view.build(obs)
    row = next(r for r in dash.processes if r.pid == TRAINERS[0].pid)
    detail = view.build_detail(obs, row, None)
    assert detail.device is not None and "parameters" in _breakdown(detail).plain
    unmeasured = replace(
        detail, device=replace(detail.device, breakdown=None, breakdown_measured=False)
    )
    assert _breakdown(unmeasured).plain.startswith("Not measured yet")
    no_optimizer = replace(unmeasured, device=replace(unmeasured.device, breakdown_measured=True))
    assert _breakdown(no_optimizer).plain.startswith("No optimizer seen yet")


def test_suggestions_say_collecting_until_there_is_evidence() -> None:
    # The demo's first seconds said "memory looks healthy" before anything was judged.
    store = Store()
    trainer = TRAINERS[0]
    for t in range(3):
        store.update_driver(nvml_at(t), T0 + t)
        store.update_agents([poll_at(trainer, t, TOTAL // 2)], T0 + t + 0.01)
    dash = view.build(Observer(store, clock=lambda: T0 + 3, uid=MY_UID).latest())
    assert not dash.suggestions or all(s.pid != trainer.pid for s in dash.suggestions)
    assert dash.quiet.startswith("Collecting")
    # An agent whose hello lists a GPU but whose first sample has not come: not "CPU only".
    early = Store()
    early.update_driver(nvml_at(0), T0)
    early.update_agents([AgentView(trainer.pid, CONNECTED, trainer.hello(), None)], T0)
    dash = view.build(Observer(early, clock=lambda: T0, uid=MY_UID).latest())
    assert dash.quiet.startswith("Collecting"), dash.quiet
    healthy = view.build(Observer(frozen_store(), clock=lambda: NOW, uid=MY_UID).latest())
    assert healthy.quiet == "Nothing to suggest: memory looks healthy."


# ------------------------------------------------------------------ filters (memtop.engine.scope)


def test_only_hides_a_gpus_processes_from_the_suggestions_too() -> None:
    # `--only 1` hid GPU 0 and its processes, but 4101's folded tips and 4102's leak stayed.
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        items = app.query_one(SuggestionsPane).items
        assert items and {i.pid for i in items} <= {4201, 7002, None}
        assert pids(app) == [4201, 7002]
        assert "only GPU 1" in screen_text(app.export_screenshot())

    drive(MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, only={1}), body)


def test_only_a_missing_gpu_says_so_once() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        assert "No GPU 5 on this machine (it has GPU 0, 1)" in screen
        assert "Reading devices" not in screen and "No GPUs and no PyTorch" not in screen
        assert [n for n in notifications(app) if "--only: no GPU 5" in n]

    drive(MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, only={5}), body)


def test_user_and_pid_filters_on_the_dashboard() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert pids(app) == [7001]
        assert {i.pid for i in app.query_one(SuggestionsPane).items} <= {7001, None}
        assert "user grace" in screen_text(app.export_screenshot())

    scope = Scope(users=frozenset({"grace"}))
    drive(MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, scope=scope), body)

    async def by_pid(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert pids(app) == [4102, 4201]
        assert {i.pid for i in app.query_one(SuggestionsPane).items} <= {4102, 4201, None}
        assert "pid 4102,4201" in screen_text(app.export_screenshot())

    scope = Scope(pids=frozenset({4102, 4201}))
    drive(MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, scope=scope), by_pid)


def test_filters_reach_the_report_and_the_exporter() -> None:
    from helpers.observations import frozen_observer

    from memtop.export.server import Exporter
    from memtop.present import report

    whole = frozen_observer().latest()
    assert Scope(gpus=frozenset({1, 5})).missing(whole) == [
        "--only: no GPU 5 on this machine (it has GPU 0, 1)"
    ]
    assert not Scope(gpus=frozenset({1})).missing(whole)
    data = report.build(Scope(pids=frozenset({4102})).apply(whole))
    assert [a["pid"] for a in data["agents"]] == [4102]
    assert {s["pid"] for s in data["suggestions"]} <= {4102, None}
    assert [p["pid"] for d in data["devices"] for p in d["processes"]] == [4102]
    data = report.build(Scope(gpus=frozenset({1})).apply(whole))
    assert [d["index"] for d in data["devices"]] == [1]
    assert [a["pid"] for a in data["agents"]] == [4201]

    class Idle:  # the exporter's sampler: the frozen store is already sampled
        def __init__(self) -> None:
            self.store = frozen_store()

        def sample_once(self) -> None:
            pass

    exporter = Exporter(Idle(), "127.0.0.1:0", scope=Scope(pids=frozenset({4102})))  # type: ignore[arg-type]
    exporter.round()
    body = exporter.collector.body().decode()
    assert 'pid="4102"' in body and 'pid="4101"' not in body and 'pid="4201"' not in body


def test_filter_flags_parse_as_nvitop_spells_them(capsys: pytest.CaptureFixture[str]) -> None:
    from memtop.cli import _scope, build_parser

    args = build_parser().parse_args(["--once", "--user", "ada,grace", "--pid", "4101,4102"])
    assert _scope(args) == Scope(users=frozenset({"ada", "grace"}), pids=frozenset({4101, 4102}))
    args = build_parser().parse_args(["export", "--only", "1", "--pid", "7"])
    assert _scope(args) == Scope(gpus=frozenset({1}), pids=frozenset({7}))
    assert not _scope(build_parser().parse_args(["export"]))
    assert build_parser().parse_args(["--readonly"]).readonly is True
    assert build_parser().parse_args(["demo", "--readonly"]).readonly is True
    from memtop.cli import main

    capsys.readouterr()
    assert main(["--prometheus", "http://127.0.0.1:1", "--pid", "7"]) == 1  # not ignored
    assert "do not apply to --prometheus" in capsys.readouterr().err
    for bad in (["--pid", "x"], ["--pid", "٣"], ["--user", ","]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


@pytest.mark.slow
def test_once_keeps_to_only_user_and_pid(
    leak_demo,  # type: ignore[no-untyped-def]  # noqa: F811
    socket_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `--once --only 1` ignored --only; --only 5 said nothing.  The whole machine through the
    # real command; each filter through memtop.cli.main in this process (the same parser and
    # printer, ~0.25 CPU-s less a filter than a Python process started for it).
    whole = json.loads(memtop("--once", "--json", socket_dir=socket_dir).stdout)
    (pid,) = [a["pid"] for a in whole["agents"]]
    assert [d["index"] for d in whole["devices"]] == [0]

    def once(*args: str) -> tuple[str, str]:
        capsys.readouterr()
        assert cli.main(["--once", "--socket-dir", str(socket_dir), *args]) == 0
        out = capsys.readouterr()
        return out.out, out.err

    out, err = once("--json", "--only", "1")
    data = json.loads(out)
    assert data["devices"] == [] and data["agents"] == [] and data["suggestions"] == []
    assert "no GPU 1 on this machine (it has GPU 0)" in err
    assert err.count("\n") == 1
    data = json.loads(once("--json", "--pid", str(pid))[0])
    assert [a["pid"] for a in data["agents"]] == [pid]
    data = json.loads(once("--json", "--pid", "1")[0])
    assert data["agents"] == [] and data["devices"]  # the GPU stays, its process is filtered
    text = once("--user", "nobody-here")[0]
    assert str(pid) not in text


# ------------------------------------------------------------------ read-only, config


def test_readonly_no_key_acts_on_a_process_and_the_footer_says_so(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('readonly = true\n[keys]\nsnapshot = "S"\n')
    cfg = config.load(path)
    assert cfg.readonly is True and not cfg.problems

    def last_row(app: MemtopApp) -> str:
        return screen_text(app.export_screenshot()).splitlines()[-1]

    async def footer_drawn(app: MemtopApp, pilot) -> str:  # type: ignore[no-untyped-def]
        # Under two suites at once the first screenshot's last row held a toast ("agent 4201
        # attached") where the footer was not laid out yet.
        await wait_for(pilot, lambda: "q Quit" in last_row(app))
        return last_row(app)

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        footer = await footer_drawn(app, pilot)
        assert footer.endswith("q Quit · read-only"), footer
        assert not any(word in footer for word in ("Cleanup", "Reset", "Snapshot", "Kill")), footer
        default = app.screen
        for key in ("c", "r", "S", "k", "a"):  # S: snapshot as the keymap binds it
            await pilot.press(key)
            await pilot.pause(0.05)
            assert app.screen is default  # no kill or attach dialog
        said = notifications(app)
        assert len([n for n in said if "Read-only" in n]) == 5
        assert not any("Cleaning" in n or "Writing a snapshot" in n for n in said)
        await pilot.press("enter")  # the detail screen: the same
        await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
        await pilot.press("k")
        await pilot.pause(0.05)
        assert isinstance(app.screen, DetailScreen)
        assert "read-only" in screen_text(app.export_screenshot()).splitlines()[-1]
        await pilot.press("escape", "question_mark")
        await pilot.pause(0.2)
        assert "Read-only (--readonly)" in screen_text(app.export_screenshot())

    app = MemtopApp(
        frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, config=cfg, readonly=cfg.readonly
    )
    drive(app, body)

    async def live(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        footer = await footer_drawn(app, pilot)
        assert "read-only" not in footer and "Kill" in footer
        await pilot.press("k")
        await pilot.pause(0.1)
        assert not any("Read-only" in n for n in notifications(app))

    drive(frozen_app(), live)


def test_a_key_another_binding_has_is_a_warning_and_the_default_stays(tmp_path: Path) -> None:
    # `cleanup = "q"` silently took q from quit.
    path = tmp_path / "config.toml"
    path.write_text('[keys]\ncleanup = "q"\nkill = ""\nhelp = "h"\n')
    cfg = config.load(path)
    assert cfg.problems == (f'{path}: keys.kill is empty; give a key such as "C"',)

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        said = notifications(app)
        assert [n for n in said if 'keys.cleanup = "q" takes q from quit' in n]
        assert [n for n in said if "keys.kill is empty" in n]
        await pilot.press("c")  # cleanup kept c (a frozen view: it says it cannot act)
        await pilot.pause(0.05)
        assert any("not live" in n for n in notifications(app))
        await pilot.press("h")  # a binding without a clash is rebound
        await pilot.pause(0.1)
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.press("q")  # still quits
        await pilot.pause(0.2)
        assert app.return_code == 0

    drive(MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, config=cfg), body)


def test_readme_key_table_is_the_bindings() -> None:
    # The README's table had two header rows and no `a` (attach), which `?` lists.
    from memtop.ui.screens.help import key_rows

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ")]
    start = rows.index("| key | binding id | does |")
    table = [r for r in rows[start + 1 :] if "`" in r.split("|")[2]]
    assert not any(r.startswith("| key |") for r in rows[start + 1 : start + len(table) + 1])
    by_id: dict[str, str] = {}
    for row in table:
        keys, ids = row.split("|")[1:3]
        for binding_id in re.findall(r"`([\w.]+)`", ids):
            by_id[binding_id] = keys
    ranged = re.search(r"`(table\.\w+)` … `(table\.\w+)`", readme)
    for keys, _what, binding_id in key_rows(None):
        row_keys = by_id.get(binding_id)
        if row_keys is None and ranged and binding_id.startswith("table."):
            row_keys = by_id.get(ranged.group(1))  # "table.up … table.last": the move keys
        assert row_keys is not None, f"README's key table has no row for {binding_id}"
        for key in keys.split():
            assert f"`{key}`" in row_keys, f"README: {binding_id} is bound to {key}"


def test_kill_dialog_at_80x24_shows_every_button_and_what_q_does() -> None:
    # A notification covered KILL (9), Cancel was cut off the dialog, and the footer under the
    # dialog said "q Quit" though q cancels.
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        from textual.widgets import Button

        app.notify("Cleaning up in pid 4101…", timeout=30)
        await pilot.press("k")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ConfirmScreen)
        assert not app._notifications, notifications(app)  # nothing stacks over the buttons
        dialog = app.screen.query_one("#confirm").region
        assert dialog.y <= 2  # above where new notifications appear (bottom right)
        buttons = list(app.screen.query(Button))
        assert [str(b.label) for b in buttons][-2:] == ["KILL (9)", "Cancel (n/q/esc)"]
        for button in buttons:
            assert dialog.contains_region(button.region), button.label
        footer = screen_text(app.export_screenshot()).splitlines()[-1]
        assert "Cancel" in footer and "Quit" not in footer, footer
        await pilot.press("q")
        assert not isinstance(app.screen, ConfirmScreen) and app.return_code is None

    drive(frozen_app(), body, size=(80, 24))


# ------------------------------------------------------------------ 80×24


def test_at_80x24_a_filter_shows_and_figures_are_not_cut() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        # The leak's time to full survives on its GPU card and in its suggestion (asides go
        # first: it ended "full in…").
        assert "pid 4102 +8.0M/step 49 min" in screen
        assert "Leak: +8.0 MiB per step, full in ~49 min" in screen
        await pilot.press("slash", "l", "e", "a", "k", "enter")
        await pilot.pause(0.2)
        # The compact layout draws no subtitle: nothing said a filter was on.
        assert "Processes  filter “leak” 1/5" in screen_text(app.export_screenshot())
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
        await pilot.pause(0.3)
        assert "trend +8.0 MiB/step · full in 49 min" in screen_text(app.export_screenshot())

    drive(frozen_app(), body, size=(80, 24))


def test_header_badges_stay_whole_at_80_columns() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        app._badges = lambda: [("   PAUSED (p resumes) ", "bold")]  # type: ignore[method-assign]
        assert app.dashboard is not None
        header = app._header(app.dashboard).plain
        assert header.endswith("PAUSED (p resumes) ") and len(header) <= 80, header
        assert "gpu-box" in header and "2 GPUs" in header

    drive(frozen_app(), body, size=(80, 24))


def test_replay_header_and_footer_at_80x24() -> None:
    # The header lost "/ 02:50 ×1 PAUSED" and the footer ended "] F".
    from memtop.engine.playback import Player
    from memtop.sources.replay import load
    from memtop.ui.replay_app import ReplayApp

    recording = load(Path(__file__).parent / "data" / "traces" / "leak.jsonl.gz")
    store = Store()
    player = Player(store, recording)
    player.seek_offset(20)

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("space")
        await pilot.pause(0.2)
        lines = screen_text(app.export_screenshot()).splitlines()
        assert re.search(r"REPLAY 00:2\d / 02:50 ×1 PAUSED$", lines[0]), lines[0]
        assert lines[-1].startswith("space Play") and lines[-1].endswith("q Quit"), lines[-1]

    try:
        drive(ReplayApp(store, player, recording, host="replay"), body, size=(80, 24))
    finally:
        player.stop()


def test_eight_gpus_at_80x24_name_the_leaking_pid_and_its_time_to_full() -> None:
    # One line per GPU: it said "+8.0M/step 12 min" without the pid, or lost the time to full.
    store = frozen_store()
    reading = nvml_at(SECONDS)
    extra = tuple(
        replace(reading.devices[1], index=i, uuid=f"GPU-extra-{i}", processes=(), used_bytes=0)
        for i in range(2, 8)
    )
    store.update_driver(replace(reading, devices=reading.devices + extra), NOW)

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        line = next(x for x in screen.splitlines() if x.startswith("GPU0 "))
        assert len(line) <= 80 and line.endswith("pid 4102 +8.0M/step 49 min"), line
        assert "GPU7 " in screen

    drive(frozen_app(store), body, size=(80, 24))
