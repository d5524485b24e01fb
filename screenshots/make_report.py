"""Regenerate screenshots/report.html and report.png: `memtop report` of the H100 leak
recording, photographed by headless Chromium.

    .venv/bin/python screenshots/make_report.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
TRACE = HERE.parent / "tests" / "data" / "traces" / "leak.jsonl.gz"


def main() -> None:
    page = HERE / "report.html"
    subprocess.run(
        [sys.executable, "-m", "memtop", "report", str(TRACE), "-o", str(page), "--force",
         "--title", "memtop report: leak.jsonl.gz (H100)"],
        check=True,
    )  # fmt: skip
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("no chromium: apt-get install chromium")
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=980,1250", f"--screenshot={HERE / 'report.png'}", page.resolve().as_uri()],
        check=True, capture_output=True,
    )  # fmt: skip
    print(f"{page}, {HERE / 'report.png'}")


if __name__ == "__main__":
    main()
