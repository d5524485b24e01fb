"""Where a dashboard's bytes to the terminal go: row by row, over a recording of
bench/tui_cost.py --record DIR (issue 35 item 8).

    .venv/bin/python bench/tty_where.py DIR/mixed-memtop-1.tty [--regions header=1-1,...]

The recording is played into a model of the terminal (cursor moves absolute and relative,
backspace, CR/LF; styles are not modelled, only where bytes land).  Each byte of the measured
window is charged to the row of the next cell written (a move and a style before a character
are that character's cost), and each burst of output (chunks less than 10 ms apart: one frame)
that writes a row counts as one repaint of that row.  Printed: per row, its bytes per second,
repaints per second, the columns written (as spans) and the row's text at the end; then per
region (a widget's rows, as --regions names them, or guessed from the final screen).

The last line of output is one JSON object: the per-row and per-region figures.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from collections import Counter, defaultdict
from pathlib import Path

MAGIC = b"memtop-tty-1\n"
BURST_GAP_S = 0.01
_TOKEN = re.compile(
    rb"(?P<csi>\x1b\[(?P<params>[0-?]*)[ -/]*(?P<final>[@-~]))"
    rb"|(?P<osc>\x1b\][^\x07\x1b]*(?:\x07|\x1b\\))"
    rb"|(?P<esc>\x1b[@-Z\\-_0-9=>])"
    rb"|(?P<ctl>[\x00-\x1a\x1c-\x1f\x7f])"
    rb"|(?P<text>[^\x00-\x1f\x7f\x1b]+)"
)


def load(path: Path) -> tuple[dict[str, float], list[tuple[float, bytes]]]:
    raw = path.read_bytes()
    if not raw.startswith(MAGIC):
        raise SystemExit(f"{path}: not a bench/tui_cost.py --record file")
    header_end = raw.index(b"\n", len(MAGIC))
    header = json.loads(raw[len(MAGIC) : header_end])
    chunks: list[tuple[float, bytes]] = []
    at = header_end + 1
    while at < len(raw):
        t, n = struct.unpack_from("<dI", raw, at)
        at += 12
        chunks.append((t, raw[at : at + n]))
        at += n
    return header, chunks


def analyse(header: dict[str, float], chunks: list[tuple[float, bytes]]) -> dict[str, object]:
    rows, columns = int(header["rows"]), int(header["columns"])
    start, end = header["start"], header["end"]
    screen = [[" "] * columns for _ in range(rows)]
    row = col = 1
    row_bytes: Counter[int] = Counter()
    row_repaints: Counter[int] = Counter()
    row_cells: dict[int, Counter[int]] = defaultdict(Counter)  # row -> column -> writes
    cell_bytes: dict[int, Counter[int]] = defaultdict(Counter)  # row -> first column -> bytes
    pending = 0  # bytes of moves and styles not yet charged to a written cell
    burst_rows: set[int] = set()
    last_t = None
    total = 0
    # One stream: an escape sequence may be split between two reads of the pty.
    stream = b"".join(data for _, data in chunks)
    starts: list[tuple[int, float]] = []  # (offset, time) of each chunk
    offset = 0
    for t, data in chunks:
        starts.append((offset, t))
        offset += len(data)
    chunk = 0
    for match in _TOKEN.finditer(stream):
        while chunk + 1 < len(starts) and starts[chunk + 1][0] <= match.start():
            chunk += 1
            t = starts[chunk][1]
            if last_t is None or t - last_t > BURST_GAP_S:
                for r in burst_rows:
                    row_repaints[r] += 1
                burst_rows = set()
            last_t = t
        t = starts[chunk][1]
        inside = start <= t < end
        kind = match.lastgroup
        size = len(match.group())
        if inside:
            total += size
        if kind == "text":
            chars = match.group().decode("utf-8", "replace")
            if inside:
                row_bytes[row] += size + pending
                cell_bytes[row][col] += size + pending
                burst_rows.add(row)
                for i in range(len(chars)):
                    row_cells[row][col + i] += 1
            pending = 0
            for char in chars:
                if 1 <= row <= rows and 1 <= col <= columns:
                    screen[row - 1][col - 1] = char
                col += 1
            continue
        if inside:
            pending += size
        if kind == "csi":
            final, params = match.group("final").decode(), match.group("params").decode()
            if params.startswith("?"):
                continue
            n = int(params) if params.isdigit() else 1
            if final in "Hf":
                parts = params.split(";") if params else []
                row = int(parts[0]) if parts and parts[0] else 1
                col = int(parts[1]) if len(parts) > 1 and parts[1] else 1
            elif final == "A":
                row = max(1, row - n)
            elif final == "B":
                row += n
            elif final == "C":
                col += n
            elif final == "D":
                col = max(1, col - n)
            elif final == "J" and params == "2":
                screen = [[" "] * columns for _ in range(rows)]
        elif kind == "ctl":
            char = match.group()
            if char == b"\r":
                col = 1
            elif char == b"\n":
                row += 1
            elif char == b"\b":
                col = max(1, col - 1)
    for r in burst_rows:
        row_repaints[r] += 1
    seconds = end - start
    lines = ["".join(line).rstrip() for line in screen]
    per_row = []
    for r in range(1, rows + 1):
        cells = row_cells.get(r, Counter())
        per_row.append(
            {
                "row": r,
                "bytes_per_s": round(row_bytes[r] / seconds, 1),
                "repaints_per_s": round(row_repaints[r] / seconds, 2),
                "columns": _spans(cells, cell_bytes.get(r, Counter())),
                "text": lines[r - 1],
            }
        )
    return {
        "seconds": round(seconds, 2),
        "bytes_per_s": round(total / seconds, 1),
        "rows": per_row,
        "screen": lines,
    }


def _spans(writes: Counter[int], charged: Counter[int]) -> str:
    """The columns written, as runs of adjacent columns, each with how many times its most
    written cell was written and the bytes charged to it, moves and styles included
    ("78-80×10=96B")."""
    spans: list[str] = []
    run: list[int] = []
    for col in sorted(writes):
        if run and col != run[-1] + 1:
            spans.append(_span(run, writes, charged))
            run = []
        run.append(col)
    if run:
        spans.append(_span(run, writes, charged))
    return " ".join(spans)


def _span(run: list[int], writes: Counter[int], charged: Counter[int]) -> str:
    where = f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"
    return f"{where}×{max(writes[c] for c in run)}={sum(charged[c] for c in run)}B"


def guess_regions(lines: list[str]) -> dict[str, tuple[int, int]]:
    """memtop's widgets by the rows they take on the final screen: the header (row 1), the
    GPU cards (to the line before "Processes"), the process table (to the line before
    "Suggestions", or a blank), the suggestions, the footer (the last row)."""
    n = len(lines)
    processes = next((i for i, line in enumerate(lines, 1) if "Processes" in line), None)
    suggestions = next(
        (i for i, line in enumerate(lines, 1) if "Suggestion" in line and i > (processes or 0)),
        None,
    )
    regions: dict[str, tuple[int, int]] = {"header": (1, 1)}
    if processes is None:
        regions["body"] = (2, n - 1)
    else:
        regions["gpu cards"] = (2, processes - 1)
        table_end = (suggestions - 1) if suggestions else n - 2
        regions["process table"] = (processes, table_end)
        if suggestions:
            regions["suggestions"] = (suggestions, n - 2)
    regions["status line"] = (n - 1, n - 1)
    regions["footer"] = (n, n)
    return regions


def parse_regions(text: str) -> dict[str, tuple[int, int]]:
    regions: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        name, _, span = part.partition("=")
        first, _, last = span.partition("-")
        regions[name.strip()] = (int(first), int(last or first))
    return regions


def main() -> int:
    parser = argparse.ArgumentParser(description="a recording's bytes to the terminal, by row")
    parser.add_argument("recording", type=Path)
    parser.add_argument(
        "--regions", default=None, help="NAME=FIRST-LAST,... rows (default: memtop's, guessed)"
    )
    args = parser.parse_args()
    header, chunks = load(args.recording)
    result = analyse(header, chunks)
    lines = result["screen"]
    assert isinstance(lines, list)
    regions = parse_regions(args.regions) if args.regions else guess_regions(lines)
    rows = result["rows"]
    assert isinstance(rows, list)
    print(f"{args.recording.name}: {result['bytes_per_s']} B/s over {result['seconds']} s")
    print(f"{'row':>3} {'B/s':>7} {'rep/s':>5}  columns written / text at the end")
    for r in rows:
        if r["bytes_per_s"] or r["text"]:
            print(
                f"{r['row']:>3} {r['bytes_per_s']:>7.1f} {r['repaints_per_s']:>5.2f}  "
                f"{r['text'][:100]}"
            )
            if r["columns"]:
                print(f"{'':>19}cols {r['columns']}")
    by_region = {}
    for name, (first, last) in regions.items():
        inside = [r for r in rows if first <= r["row"] <= last]
        by_region[name] = {
            "rows": f"{first}-{last}",
            "bytes_per_s": round(sum(r["bytes_per_s"] for r in inside), 1),
            "row_repaints_per_s": round(sum(r["repaints_per_s"] for r in inside), 2),
        }
    print(f"\n{'region':<16}{'rows':>8}{'B/s':>9}{'share':>8}{'row repaints/s':>16}")
    total = float(result["bytes_per_s"])  # type: ignore[arg-type]
    for name, figures in by_region.items():
        share = 100 * figures["bytes_per_s"] / total if total else 0.0  # type: ignore[operator]
        print(
            f"{name:<16}{figures['rows']:>8}{figures['bytes_per_s']:>9}{share:>7.0f}%"
            f"{figures['row_repaints_per_s']:>16}"
        )
    figures = [{k: v for k, v in r.items() if k != "text"} for r in rows]
    print(json.dumps({"bytes_per_s": result["bytes_per_s"], "regions": by_region, "rows": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
