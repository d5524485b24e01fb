"""`memtop --prometheus URL`: the fleet, every host whose `memtop export` Prometheus scrapes,
on the dashboard or as a report."""

from __future__ import annotations

import argparse
import json
import sys
import time

from memtop.base.errors import MemtopError
from memtop.commands import EXIT_OK

# The fleet dashboard waits this long for its first read before it opens (then reads on).
FLEET_FIRST_READ_S = 3.0


def run(args: argparse.Namespace) -> int:
    from memtop.engine import fleet
    from memtop.present import fleet_report
    from memtop.sources.prometheus import PrometheusSource

    source = PrometheusSource(args.prometheus)
    if args.once:
        reading, observations = fleet.fleet_observations(source)
        data = fleet_report.build(source.url, observations, reading.problems)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            sys.stdout.write(fleet_report.render_text(data))
        return EXIT_OK
    sampler = fleet.FleetSampler(source, interval=max(args.interval, 1.0))
    if sys.stdout.isatty() and sys.stdin.isatty():
        # The first read, on the sampler's thread: a wrong URL is one line now, not an empty
        # dashboard, and a fleet that answers in time opens the dashboard on the fleet, not on
        # an empty state (which would also take the process table's focus away).  A server
        # that does not answer soon gets the dashboard anyway, where `q` works while it waits.
        sampler.start()
        waited = time.monotonic() + FLEET_FIRST_READ_S
        while sampler.rounds == 0 and time.monotonic() < waited:
            time.sleep(0.02)
        if sampler.rounds and sampler.error:
            sampler.stop()
            raise MemtopError(sampler.error)
        from memtop.ui.app import MemtopApp

        try:
            MemtopApp(
                sampler.store,
                sampler,
                interval=args.interval,
                host=f"fleet ({source.url})",
                observer=sampler.observer(),
                readonly=args.readonly,
            ).run()
        finally:
            sampler.stop()
        return EXIT_OK
    while True:  # not a terminal: the fleet report at the interval
        _, observations = fleet.fleet_observations(source)
        data = fleet_report.build(source.url, observations)
        sys.stdout.write(fleet_report.render_text(data) + "\n")
        sys.stdout.flush()
        time.sleep(args.interval)
