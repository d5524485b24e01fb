"""`memtop report` (issue 33.3): one self-contained page from a recording, whose figures are
`memtop replay --once --json --at T`'s, that fetches nothing, escapes what agents said, stays
small, and loads in a real headless browser."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from memtop.cli import main

TRACES = Path(__file__).resolve().parent / "data" / "traces"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _report(tmp_path: Path, source: Path, name: str = "r.html") -> str:
    out = tmp_path / name
    assert main(["report", str(source), "-o", str(out)]) == 0
    return out.read_text()


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(page)
    return parser.tags


def test_the_page_holds_the_leak_and_fetches_nothing(tmp_path: Path):
    page = _report(tmp_path, TRACES / "leak.jsonl.gz")
    tags = _tags(page)
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe", "object")]
    assert not [a for _, a in tags for k in ("src", "href") if a.get(k)]
    assert "url(" not in page and "@import" not in page
    assert "+12.0 MiB per step" in page  # the leak's verdict, as the trace's truth says
    assert page.count("<svg") == 1 and "trend" in page and "baseline" in page
    assert len(page) < 100_000


def test_the_marked_moments_are_what_replay_once_json_says(tmp_path: Path):
    trace = TRACES / "fragment.jsonl.gz"
    page = _report(tmp_path, trace)
    rows = re.findall(
        r'data-at="([\d.]+)" data-pid="(\d+)" data-device="(\d+)" data-allocated="(\d+)" '
        r'data-reserved="(\d+)" data-peak="(\d+)"',
        page,
    )
    assert len(rows) == 5
    for at, pid, device, allocated, reserved, peak in (rows[1], rows[4]):
        done = subprocess.run(
            [sys.executable, "-m", "memtop", "replay", str(trace), "--once", "--json", "--at", at],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        data = json.loads(done.stdout)
        (agent,) = [a for a in data["agents"] if a["pid"] == int(pid)]
        (figures,) = [d for d in agent["devices"] if d["index"] == int(device)]
        assert (figures["allocated_bytes"], figures["reserved_bytes"], figures["peak_bytes"]) == (
            int(allocated), int(reserved), int(peak)
        )  # fmt: skip


def test_what_an_agent_said_is_text_not_markup(tmp_path: Path):
    """A recording whose agent names itself `<script>…` and whose path is markup: escaped."""
    lines = gzip.decompress((TRACES / "healthy.jsonl.gz").read_bytes()).decode().splitlines()
    first = json.loads(lines[0])
    first["reply"]["result"]["argv"] = ["<script>alert(1)</script>", '"><img src=x onerror=y>']
    lines[0] = json.dumps(first)
    hostile = tmp_path / "<svg onload=alert(2)>.jsonl.gz"
    hostile.write_bytes(gzip.compress(("\n".join(lines[:200]) + "\n").encode()))
    page = _report(tmp_path, hostile)
    assert "<script>" not in page and "<img" not in page and "<svg onload" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert not [t for t, _ in _tags(page) if t in ("script", "img")]
    assert not [a for _, a in _tags(page) if "onload" in a or "onerror" in a]


def test_an_existing_file_or_a_link_is_not_written(tmp_path: Path, capsys):
    out = tmp_path / "r.html"
    out.write_text("mine")
    assert main(["report", str(TRACES / "leak.jsonl.gz"), "-o", str(out)]) == 1
    assert "exists; add --force" in capsys.readouterr().err and out.read_text() == "mine"
    link = tmp_path / "link.html"
    link.symlink_to(tmp_path / "elsewhere.html")
    assert main(["report", str(TRACES / "leak.jsonl.gz"), "-o", str(link), "--force"]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere.html").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (.ci/run installs it)")
def test_the_page_of_every_trace_loads_in_a_headless_browser(tmp_path: Path):
    page = tmp_path / "all.html"
    assert main(["report", str(TRACES), "-o", str(page)]) == 0
    assert len(page.read_bytes()) < 2_000_000
    shot = tmp_path / "all.png"
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", "--window-size=980,2000",
         f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one
