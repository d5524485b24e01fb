"""Regenerate the README's screenshots: the dashboard on each demo scenario, and the detail
screen, as Textual SVG plus a PNG of each (cairosvg).

    .venv/bin/python screenshots/make.py [--only mixed,detail] [--size 120x36]

Each scenario runs real simulated trainers (as `memtop demo` does) in a private socket
directory for long enough that the diagnosis has something to say, then the dashboard is
driven with Textual's pilot and saved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import cairosvg

from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource
from memtop.ui.app import MemtopApp
from memtop.ui.widgets.process_table import ProcessTable

HERE = Path(__file__).parent
# (name, scenario, GPUs, seconds to run before the picture, keys pressed before it)
SHOTS = (
    ("mixed", "mixed", 2, 40, ()),
    ("leak", "leak", 1, 30, ()),
    ("fragment", "fragment", 1, 30, ()),
    ("pressure", "pressure", 1, 40, ()),
    ("oom", "oom", 1, 75, ()),
    ("detail", "mixed", 2, 40, ("leak-row", "enter")),
    ("mixed-80x24", "mixed", 2, 40, ()),
    # Eight GPUs on 80×24: the first screen names the leaking pid and its time to full.
    ("mixed-8gpu-80x24", "mixed", 8, 40, ()),
    ("detail-80x24", "mixed", 2, 40, ("leak-row", "enter")),
    # What an nvitop user reaches for: sort, filter, rank grouping, a theme, the help.
    ("ranks", "mixed", 4, 40, ()),
    ("sorted", "mixed", 4, 40, ("sort:allocated",)),
    ("filter", "mixed", 4, 40, ("slash", *"leak", "enter")),
    ("monochrome", "mixed", 2, 40, ("theme:monochrome",)),
    ("help", "mixed", 2, 5, ("question_mark",)),
    ("kill-dialog", "mixed", 2, 10, ("leak-row", "k")),
    # Who holds the memory: the leak demo with allocation stacks recorded (MEMTOP_STACKS=1),
    # its detail screen's table by line, the leaking line on top.
    ("leak-stacks", "leak", 1, 60, ("leak-row", "enter")),
    # AMD GPUs: `memtop demo --vendor amd` (simulated MI300Xs, trainers on ROCm).
    ("amd", "mixed", 2, 40, ()),
    # An inference server that preallocates 0.92 of its GPU: named, and judged by its request.
    ("server", "server", 1, 25, ()),
    # A GPU's own screen (tab to its card, enter): who holds its memory.
    ("gpu-detail", "mixed", 2, 30, ("gpu-card", "enter")),
)
# Shots of another vendor's simulated GPUs than NVIDIA's (Demo's `vendor`).
VENDORS = {"amd": "amd"}
# Shots whose trainers record allocation stacks (the environment `memtop run --stacks` sets).
STACKS = {"leak-stacks"}


async def shoot(name: str, socket_dir: Path, seconds: float, keys: tuple[str, ...], size) -> Path:  # type: ignore[no-untyped-def]
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    sampler.start()
    from memtop.ui.config import UiConfig

    themes = [key.split(":", 1)[1] for key in keys if key.startswith("theme:")]
    config = UiConfig(theme=themes[0]) if themes else None
    app = MemtopApp(store, sampler, host="gpu-box", config=config)
    try:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(seconds)
            for key in keys:
                if key == "leak-row":  # the leaking trainer, wherever it sorts
                    table = app.query_one(ProcessTable)
                    for row_key, row in table.rows_by_key.items():
                        if row.trend:
                            table.move_cursor(row=table.get_row_index(row_key))
                elif key.startswith("sort:"):  # as `>` pressed until that column
                    table = app.query_one(ProcessTable)
                    while table.sort_key != key.split(":", 1)[1]:
                        await pilot.press("greater_than_sign")
                elif key.startswith("theme:"):
                    continue
                elif key == "gpu-card":  # focus the first GPU's card, as tab reaches it
                    from memtop.ui.widgets.gpu_panel import GpuCard

                    app.query(GpuCard).first().focus()
                else:
                    await pilot.press(key)
                await pilot.pause(1.5)
            svg = HERE / f"{name}.svg"
            app.save_screenshot(str(svg.name), path=str(HERE))
    finally:
        sampler.stop()
    return to_png(svg)


def to_png(svg: Path) -> Path:
    """cairosvg cannot fetch the SVG's web font and ignores the per-run text lengths, so runs
    of block glyphs drift; a local monospace font with block elements keeps columns aligned."""
    text = svg.read_text().replace("Fira Code, monospace", "DejaVu Sans Mono")
    text = text.replace('"Fira Code"', '"DejaVu Sans Mono"')
    # DejaVu Sans Mono has no braille (the detail chart's dots): those runs take DejaVu Sans's,
    # which cairo does not substitute on its own (they drew as boxes).
    text = re.sub(
        r"<text ([^>]*)>([^<]*[\u2800-\u28ff][^<]*)</text>",
        r'<text style="font-family:DejaVu Sans" \1>\2</text>',
        text,
    )
    png = svg.with_suffix(".png")
    cairosvg.svg2png(bytestring=text.encode(), write_to=str(png), output_width=1600)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated shot names")
    args = parser.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    for name, scenario, gpus, seconds, keys in SHOTS:
        if wanted and name not in wanted:
            continue
        size = (80, 24) if name.endswith("80x24") else (120, 36)
        socket_dir = Path(tempfile.mkdtemp(prefix="mt-shot-", dir="/tmp"))
        socket_dir.chmod(0o700)
        started = time.monotonic()
        try:
            vendor = VENDORS.get(name, "nvidia")
            if name in STACKS:
                os.environ["MEMTOP_STACKS"] = "1"
            else:
                os.environ.pop("MEMTOP_STACKS", None)
            with Demo(gpus, scenario, 0.1, socket_dir=socket_dir, vendor=vendor) as demo:
                if not demo.wait_ready():
                    raise SystemExit(f"{name}: simulated trainers failed to start")
                png = asyncio.run(shoot(name, socket_dir, seconds, keys, size))
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)
        print(f"{name}: {png.relative_to(HERE.parent)} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
