"""`memtop export`: serve Prometheus metrics on /metrics."""

from __future__ import annotations

import argparse
import sys

from memtop.base import children
from memtop.commands import EXIT_OK, common


def run(args: argparse.Namespace) -> int:
    from memtop.export.server import Exporter, ExportError, load_web_config

    config = load_web_config(args.web_config) if args.web_config else None
    exporter = Exporter(
        common.make_sampler(args),
        args.listen,
        host=args.hostname,
        job=args.job,
        web_config=config,
        scope=common.scope(args),
    )
    alerts = common.alerts(
        args, exporter.observer, lambda line: print(f"memtop export: {line}", file=sys.stderr)
    )
    # SIGTERM (and SIGHUP) end it as Ctrl-C does, from before "serving" is said: whoever read
    # that line may stop it at once (a TERM that came before the handler killed it, exit -15).
    with children.interrupted_by_signals():
        try:
            host, port = exporter.start_http()  # a port in use fails before any sampling
        except ExportError:
            exporter.sampler.stop()
            raise
        try:
            exporter.round()  # "serving" is said once there is something to serve
            # `--only 99` on a machine without a GPU 99 exported nothing and said nothing.
            for line in exporter.scope.missing(exporter.observer.latest()):
                print(f"memtop export: warning: {line}", file=sys.stderr, flush=True)
            scheme = "https" if config is not None and config.tls else "http"
            print(f"memtop export: serving {scheme}://{host}:{port}/metrics", flush=True)
            if exporter.exposed:
                print(
                    f"memtop export: warning: {host} is not loopback; anyone who reaches port "
                    f"{port} reads this host's process ids, commands and memory"
                    + (
                        ""
                        if config is not None and config.users
                        else " (no basic auth: see --web-config)"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            exporter.run(args.interval)
        except KeyboardInterrupt:
            pass
        finally:
            exporter.stop()
            exporter.sampler.stop()
            if alerts is not None:
                alerts.close()
    return EXIT_OK
