"""`memtop oom [FILE]`: the OOM reports trainers left here, each explained."""

from __future__ import annotations

import argparse
import json

from memtop.commands import EXIT_OK


def run(args: argparse.Namespace) -> int:
    from memtop.oom import render
    from memtop.oom.reports import list_reports, load_report

    if args.file is not None:
        report = load_report(args.file)
        if args.json:
            print(json.dumps(render.report_json(report), indent=2))
        else:
            print(render.report_text(report))
        return EXIT_OK
    directory, reports, problems = list_reports()
    if args.json:
        print(json.dumps(render.list_json(str(directory), reports, problems), indent=2))
    else:
        print(render.list_text(str(directory), reports, problems))
    return EXIT_OK
