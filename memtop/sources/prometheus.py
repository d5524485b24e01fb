"""The fleet source: what `memtop export` on many hosts put into Prometheus, read back through
the PromQL HTTP API (`/api/v1/query`, `/api/v1/query_range`).

One instant query fetches every `memtop_*` series (or, given one `memtop export`'s URL instead
of Prometheus's, one scrape of its /metrics); they are grouped by their `hostname` label into
one `HostReading` per host holding the same kinds of readings the local sampler writes into a
store: an `DriverReading` of the host's GPUs, one `AgentView` per agent (hello and sample rebuilt
from the series), the breakdowns, and the host's own verdicts (leak, smoothed fragmentation,
snapshot figures), which the fleet view shows as judged there rather than judging again from
coarser data.  The metric names are those of `memtop.export.metrics`; the per-device ones, and
where each is put back, are the rows of `memtop.figures.metric_table`.

Prometheus attaches its own `job` target label to every series; with `honor_labels: false` (its
default) memtop's `job` arrives as `exported_job`, and both spellings are read.

The server is trusted for nothing (issue 27): every read has a total deadline, not just a socket
timeout (a server dripping a byte every 2 s kept `--once` running past 60 s), and runs on a
worker thread that the caller stops waiting for at the deadline or at `close()` (the dashboard's
`q`); a reply is read up to MAX_REPLY_BYTES and parsed by memtop.base.untrusted (depth, numbers);
credentials in the URL go only to the URL's own origin, never to where a redirect points.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from memtop.base import untrusted
from memtop.base.errors import MemtopError
from memtop.base.jobs import hello_fields_from_labels
from memtop.base.records import record
from memtop.figures import metric_table
from memtop.model import (
    SOURCE_AGENT,
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    AgentStatus,
    AgentView,
    DeviceReading,
    DriverReading,
    GpuProcess,
)
from memtop.protocol.text import clean_text, decimal

ALL_SERIES = '{__name__=~"memtop_.+"}'
# Targets that exported memtop series in the last hour and failed their newest scrape.
DOWN = "count_over_time(memtop_observation_time_seconds[1h]) and on (job, instance) (up == 0)"
# A reply is refused before it is parsed past these (a 57 MB one took 44 s and 1.9 GB): every
# series of 80 hosts of 8 GPUs fits (memtop's series are about 600 bytes and 12 items each,
# 40 per agent device), and no reply holds more than MAX_REPLY_ITEMS values or containers
# (counted by their commas and brackets, strings included), whose objects then take ~100 MB
# at most where 16 MiB of `{},` alone would have made 5.6 M dicts.
MAX_REPLY_BYTES = 16 << 20
MAX_REPLY_ITEMS = 1_000_000
READ_DEADLINE_S = 10.0  # one read of the fleet (two queries) or of its history, all told
_CHUNK = 1 << 16
# The sampled history the dashboard draws, by store column (and the rows of the metric table
# it comes from), and the series that says which of the trainer's CUDA devices a GPU is.
_HISTORY_ROWS = {"allocated": "allocated", "reserved": "reserved", "torch_peak": "peak"}
HISTORY_SERIES = {
    column: metric_table.by_key()[key].series or "" for column, key in _HISTORY_ROWS.items()
}

INDEX_SERIES = metric_table.by_key()["cuda_index"].series or ""


class PrometheusError(MemtopError):
    """Prometheus could not be asked, or did not answer a query: one line for the user."""


class PrometheusHTTPError(PrometheusError):
    """An HTTP error status (a 404 where the query API should be: perhaps an exporter)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@record(frozen=True)
class HostReading:
    """Everything one host's exporter reported, as readings of the local kinds."""

    host: str
    time: float  # the host's newest observation (unix seconds)
    driver: DriverReading
    polls: tuple[AgentView, ...]
    breakdowns: Mapping[int, dict[str, Any]]  # pid -> a `breakdown` reply
    verdicts: Mapping[tuple[int, int], dict[str, float]]  # (pid, cuda index) -> judged there
    jobs: Mapping[int, str]  # pid -> job label
    instance: str | None = None  # the scrape target, as Prometheus names it


@record(frozen=True)
class FleetReading:
    time: float
    hosts: tuple[HostReading, ...]
    problems: tuple[str, ...] = ()


@dataclass
class _Device:
    index: int | None = None
    uuid: str = ""
    name: str = ""
    gpu: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    free: int = 0
    total: int = 0
    verdict: dict[str, float] = field(default_factory=dict)
    breakdown: dict[str, int] = field(default_factory=dict)

    def put(self, place: metric_table.FleetPlace, key: str, value: float) -> None:
        """One series of the metric table, where its row's `fleet` says."""
        if place == metric_table.STATS:
            self.stats[key] = int(value)
        elif place == metric_table.VERDICT:
            self.verdict[key] = value
        elif place == metric_table.BREAKDOWN:
            self.breakdown[key] = int(value)
        elif key == "index":
            self.index = int(value)
        elif key == "free":
            self.free = int(value)
        elif key == "total":
            self.total = int(value)


class _Fetch:
    """One query's sockets: shut at the deadline or at close(), so that a worker stuck in a
    read (a server that drips, or says nothing) ends at once rather than at its socket timeout.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.finished = threading.Event()  # the worker is done, or the caller gave up
        self.abandoned = False

    def register(self, sock: socket.socket) -> None:
        with self._lock:
            if self.abandoned:  # given up before this connection was made
                _shut(sock)
            self._sockets.append(sock)

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            for sock in self._sockets:
                _shut(sock)
        self.finished.set()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _registering(base: type[http.client.HTTPConnection], fetch: _Fetch) -> Callable[..., Any]:
    """An HTTP(S) connection class whose sockets `fetch` can shut: the TCP socket as soon as
    it is connected (a TLS handshake included), and the TLS socket once it is made."""

    def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
        connection = base(*args, **kwargs)

        def create(address: Any, timeout: Any, source_address: Any = None) -> socket.socket:
            sock = socket.create_connection(address, timeout, source_address)
            fetch.register(sock)
            return sock

        connection._create_connection = create  # type: ignore[attr-defined]
        connect = connection.connect

        def connect_and_register() -> None:
            connect()
            if connection.sock is not None:
                fetch.register(connection.sock)

        connection.connect = connect_and_register  # type: ignore[method-assign]
        return connection

    return make


class _Registering:
    """Mixed into urllib's HTTP and HTTPS handlers: every connection they open is one whose
    sockets the fetch can shut (whatever arguments this Python's handler passes along)."""

    fetch: _Fetch

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_registering(http_class, self.fetch), req, **kwargs)  # type: ignore[misc]


class _HttpHandler(_Registering, urllib.request.HTTPHandler):
    pass


class _HttpsHandler(_Registering, urllib.request.HTTPSHandler):
    pass


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port): what credentials are bound to (as browsers and curl bind them)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect within http(s) only, and drops the credentials of the URL when the
    redirect leaves its origin (urllib forwards every header to wherever it points)."""

    max_redirections = 5

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.URLError(f"redirected to {newurl[:100]!r}, not http(s)")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and origin(new.full_url) != origin(req.full_url):
            new.remove_header("Authorization")
        return new


class PrometheusSource:
    """A client of one Prometheus server's HTTP API (no state between reads)."""

    def __init__(self, url: str, timeout: float = 5.0, deadline: float = READ_DEADLINE_S) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PrometheusError(f"--prometheus wants http(s)://HOST:PORT, got {url!r}")
        self.headers = {"Accept": "application/json"}
        if parts.username is not None:  # http://user:password@host:9090
            secret = f"{urllib.parse.unquote(parts.username)}:"
            secret += urllib.parse.unquote(parts.password or "")
            self.headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            parts = parts._replace(netloc=netloc)
        self.url = urllib.parse.urlunsplit(parts).rstrip("/")
        self.timeout = timeout
        self.deadline = deadline
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._fetches: set[_Fetch] = set()
        # `memtop export` itself rather than Prometheus: read its /metrics (one host, no
        # history).  Known from a URL that names /metrics, or found when the API is missing.
        self.exporter_path = parts.path.rstrip("/").endswith("/metrics")
        self.exporter = self.exporter_path

    @property
    def name(self) -> str:
        return "the memtop exporter" if self.exporter else "Prometheus"

    def close(self) -> None:
        """Stop every read in progress now (it raises PrometheusError) and refuse new ones:
        quitting the dashboard never waits for a server."""
        self._closed.set()
        with self._lock:
            fetches = list(self._fetches)
        for fetch in fetches:
            fetch.abandon()

    # ------------------------------------------------------------------ the HTTP API

    def _get(self, path: str, params: dict[str, str], until: float | None = None) -> Any:
        """One query's `data`, by `until` (time.monotonic(); default: `deadline` from now)."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        return self._bounded(lambda fetch: self._data(self._fetch(url, fetch)), until)

    def _bounded(self, work_on: Callable[[_Fetch], Any], until: float | None = None) -> Any:
        """`work_on(fetch)` run on a worker thread, its result by `until` (time.monotonic();
        default: `deadline` from now) or PrometheusError: its socket is shut at the deadline
        or on close()."""
        until = time.monotonic() + self.deadline if until is None else until
        fetch = _Fetch()
        outcome: list[Any] = []

        def work() -> None:
            try:
                outcome.append(work_on(fetch))
            except BaseException as exc:  # handed to the caller, who says it in one line
                outcome.append(exc)
            finally:
                fetch.finished.set()

        with self._lock:
            if self._closed.is_set():
                raise PrometheusError(f"{self.name} at {self.url}: reading stopped")
            self._fetches.add(fetch)
        try:
            threading.Thread(target=work, name="memtop-prometheus", daemon=True).start()
            in_time = fetch.finished.wait(max(0.0, until - time.monotonic()))
        finally:
            with self._lock:
                self._fetches.discard(fetch)
        if not in_time:
            fetch.abandon()  # the worker's socket is shut: it ends now, its reply unread
            raise PrometheusError(
                f"{self.name} at {self.url} did not answer within {self.deadline:g} s"
            )
        if fetch.abandoned:  # close(): whatever the worker made of its shut socket is moot
            raise PrometheusError(f"{self.name} at {self.url}: reading stopped")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _fetch(self, url: str, fetch: _Fetch) -> bytearray:
        """The request itself, on the worker thread: its body, at most MAX_REPLY_BYTES and
        MAX_REPLY_ITEMS values."""
        http_handler, https_handler = _HttpHandler(), _HttpsHandler()
        http_handler.fetch = https_handler.fetch = fetch
        opener = urllib.request.build_opener(http_handler, https_handler, _Redirects())
        request = urllib.request.Request(url, headers=self.headers)
        try:
            with opener.open(request, timeout=self.timeout) as reply:
                length = reply.headers.get("Content-Length")
                if length and length.isdigit() and int(length) > MAX_REPLY_BYTES:
                    raise PrometheusError(
                        f"{self.name} at {self.url}: reply of {int(length)} bytes, "
                        f"over {MAX_REPLY_BYTES >> 20} MiB"
                    )
                body = bytearray()  # grown in place: never a second copy of it
                while len(body) <= MAX_REPLY_BYTES:
                    chunk = reply.read(_CHUNK)
                    if not chunk:
                        break
                    body += chunk
        except urllib.error.HTTPError as exc:
            detail = clean_text(_error_of(exc.read(4096)) or exc.reason, 300)
            raise PrometheusHTTPError(
                exc.code, f"{self.name} at {self.url}: HTTP {exc.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = clean_text(getattr(exc, "reason", exc), 300)
            raise PrometheusError(f"cannot reach {self.name} at {self.url}: {reason}") from None
        if len(body) > MAX_REPLY_BYTES:
            raise PrometheusError(
                f"{self.name} at {self.url}: reply over {MAX_REPLY_BYTES >> 20} MiB"
            )
        items = body.count(b",") + body.count(b"[") + body.count(b"{") + body.count(b"\n")
        if items > MAX_REPLY_ITEMS:
            raise PrometheusError(
                f"{self.name} at {self.url}: a reply of over {MAX_REPLY_ITEMS:,} values"
            )
        return body

    def _data(self, body: bytearray) -> Any:
        """A query reply's `data`: parsed as untrusted JSON, checked for Prometheus's shape."""
        try:
            data = untrusted.loads(body)
        except untrusted.UntrustedInput as exc:
            raise PrometheusError(
                f"{self.url} did not answer as Prometheus does (its reply {exc})"
            ) from None
        if not isinstance(data, dict) or data.get("status") != "success":
            error = clean_text(data.get("error") if isinstance(data, dict) else None, 300)
            raise PrometheusError(f"Prometheus at {self.url}: query failed: {error}")
        found = data.get("data")
        if not isinstance(found, dict) or not isinstance(found.get("result", []), list):
            raise PrometheusError(f"Prometheus at {self.url}: a reply without its data")
        return found

    def query(
        self, promql: str, at: float | None = None, until: float | None = None
    ) -> list[tuple[dict[str, str], float]]:
        """An instant vector: (labels, value) per series."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params, until)
        if data.get("resultType") != "vector":
            raise PrometheusError(f"Prometheus at {self.url}: not a vector: {promql}")
        out = []
        for series in data.get("result", []):
            sample = series.get("value") if isinstance(series, dict) else None
            if not isinstance(sample, list) or len(sample) != 2:
                continue
            value = _number(sample[1])
            if value is not None:
                out.append((_labels(series), value))
        return out

    def query_range(
        self, promql: str, start: float, end: float, step: float, until: float | None = None
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """A range vector: (labels, [(time, value), ...]) per series, oldest first."""
        data = self._get(
            "/api/v1/query_range",
            {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
            until,
        )
        out = []
        for series in data.get("result", []):
            values = series.get("values") if isinstance(series, dict) else None
            if not isinstance(values, list):
                continue
            points = []
            for pair in values:
                if not isinstance(pair, list) or len(pair) != 2:
                    continue
                stamp, value = _number(pair[0]), _number(pair[1])
                if stamp is not None and value is not None:
                    points.append((stamp, value))
            out.append((_labels(series), points))
        return out

    # ------------------------------------------------------------------ readings

    def read(self) -> FleetReading:
        """Every host's newest readings (one query), and which exporters Prometheus could not
        scrape lately (their series go stale at once, so without this a host would just
        vanish).  Both queries within one `deadline`.  A URL that is one `memtop export` rather
        than Prometheus is read directly (`_scrape`): that host alone, as Prometheus would have
        stored it."""
        until = time.monotonic() + self.deadline
        if self.exporter:
            return FleetReading(time.time(), tuple(hosts_of(self._scrape(until))))
        try:
            series = self.query(ALL_SERIES, until=until)
        except PrometheusHTTPError as exc:
            if exc.status != 404:
                raise
            if not self._is_exporter(until):
                raise PrometheusError(
                    f"{exc}: no Prometheus query API there, nor a memtop exporter's /metrics; "
                    "point --prometheus at Prometheus (http://HOST:9090) or at one memtop export"
                ) from None
            return self.read()
        hosts = tuple(hosts_of(series))
        problems = []
        try:
            for labels, _ in self.query(DOWN, until=until):
                problems.append(
                    f"{labels.get('hostname', '?')}: its exporter at {labels.get('instance', '?')} "
                    "did not answer Prometheus's last scrape (up == 0)"
                )
        except PrometheusError:
            pass  # the readings stand without it
        return FleetReading(time.time(), hosts, tuple(sorted(problems)))

    def _is_exporter(self, until: float) -> bool:
        """Whether the URL (which has no Prometheus API: a 404) serves memtop_* series at
        /metrics, as `memtop export` does; from then on it is read as one."""
        try:
            found = any(labels.get("__name__") for labels, _ in self._scrape(until))
        except PrometheusError:
            return False
        if found:
            self.exporter = True
        return found

    def _scrape(self, until: float | None = None) -> list[tuple[dict[str, str], float]]:
        """One exporter's memtop_* series as Prometheus stores a scrape of them (what an
        instant query returns): empty labels dropped, memtop's `job` kept (honor_labels), the
        target named as its `instance`.  Read under the same deadline and caps as a query."""
        url = self.url if self.exporter_path else f"{self.url}/metrics"
        body = self._bounded(lambda fetch: self._fetch(url, fetch), until)
        try:
            families = list(text_string_to_metric_families(body.decode("utf-8", "replace")))
        except (ValueError, TypeError, IndexError) as exc:
            raise PrometheusError(
                f"{self.url}: neither Prometheus nor a memtop exporter "
                f"(not the Prometheus text format: {clean_text(exc, 120)})"
            ) from None
        instance = urllib.parse.urlsplit(self.url).netloc
        rows = []
        for family in families:
            for sample in family.samples:
                value = _number(sample.value)
                if not sample.name.startswith("memtop_") or value is None:
                    continue
                labels = {
                    clean_text(k, 200): clean_text(v, 1000)
                    for k, v in sample.labels.items()
                    if v != ""
                }
                rows.append(({**labels, "__name__": sample.name, "instance": instance}, value))
        if not rows:
            raise PrometheusError(
                f"{self.url}: neither Prometheus (no query API) nor a memtop exporter "
                "(no memtop_* series at /metrics): point --prometheus at your Prometheus"
            )
        return rows

    def history(
        self, seconds: float, step: float, end: float | None = None
    ) -> dict[str, dict[tuple[int, int], dict[str, list[tuple[float, float]]]]]:
        """The sampled history of every agent device: host -> (pid, cuda index) -> column ->
        [(time, value)], for the dashboard's charts (one range query per column)."""
        until = time.monotonic() + self.deadline  # all four queries
        end = time.time() if end is None else end
        out: dict[str, dict[tuple[int, int], dict[str, list[tuple[float, float]]]]] = {}
        if self.exporter:
            return out  # an exporter keeps no history: the charts start now
        index_of = {
            (labels.get("hostname", ""), labels.get("pid", ""), labels.get("UUID", "")): int(v)
            for labels, v in self.query(INDEX_SERIES, at=end, until=until)
        }
        for column, name in HISTORY_SERIES.items():
            for labels, points in self.query_range(name, end - seconds, end, step, until):
                host, pid = labels.get("hostname", ""), labels.get("pid", "")
                index = index_of.get((host, pid, labels.get("UUID", "")))
                pid_number = decimal(pid)
                if index is None or pid_number is None:
                    continue
                out.setdefault(host, {}).setdefault((pid_number, index), {})[column] = points
        return out


def _labels(series: dict[str, Any]) -> dict[str, str]:
    """A series' labels, every name and value made inert for a terminal: they come from
    whatever Prometheus (and any exporter it scrapes) says, and the fleet view prints them."""
    metric = series.get("metric")
    if not isinstance(metric, dict):
        return {}
    return {clean_text(k, 200): clean_text(v, 1000) for k, v in metric.items()}


def _number(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def _error_of(body: bytes) -> str | None:
    try:
        data = untrusted.loads(body)
    except untrusted.UntrustedInput:
        return None
    return str(data.get("error")) if isinstance(data, dict) and data.get("error") else None


def _int(text: str | None, default: int = 0) -> int:
    if text is None:
        return default
    digits = text.removeprefix("-")
    return int(text) if digits.isascii() and digits.isdigit() else default


def hosts_of(series: Iterable[tuple[dict[str, str], float]]) -> list[HostReading]:
    """Group `memtop_*` series by host and rebuild each host's readings."""
    by_host: dict[str, list[tuple[dict[str, str], float]]] = {}
    for labels, value in series:
        host = labels.get("hostname")
        if host:
            by_host.setdefault(host, []).append((labels, value))
    return [_host(host, rows) for host, rows in sorted(by_host.items())]


def _host(host: str, rows: list[tuple[dict[str, str], float]]) -> HostReading:
    stamp = 0.0
    instance = None
    gpus: dict[str, dict[str, Any]] = {}
    processes: dict[str, list[GpuProcess]] = {}
    agents: dict[int, dict[str, Any]] = {}
    devices: dict[tuple[int, str], _Device] = {}
    steps: dict[int, int] = {}

    def device(labels: dict[str, str]) -> _Device:
        key = (_int(labels.get("pid")), labels.get("UUID", ""))
        found = devices.get(key)
        if found is None:
            found = devices[key] = _Device(
                uuid=key[1], name=labels.get("modelName", ""), gpu=_int(labels.get("gpu"))
            )
        return found

    per_device = metric_table.by_series()  # the series of the metric table the fleet reads
    # The driver's figures the exporter writes, by family (memtop.figures.metric_table.GPU_METRICS).
    per_gpu = {row.prometheus: row for row in metric_table.GPU_METRICS if row.prometheus}
    for labels, value in rows:
        name = labels.get("__name__", "")
        instance = instance or labels.get("instance")
        if name == "memtop_observation_time_seconds":
            stamp = max(stamp, value)
        elif name == "memtop_gpu_info":
            gpu = gpus.setdefault(labels.get("UUID", ""), {})
            gpu.update(
                index=_int(labels.get("gpu")),
                name=labels.get("modelName", ""),
                source=labels.get("source", "nvml"),
            )
        elif (figure := per_gpu.get(name)) is not None:
            gpus.setdefault(labels.get("UUID", ""), {})[figure.field] = figure.parse(value)
        elif name == "memtop_gpu_process_used_bytes":
            processes.setdefault(labels.get("UUID", ""), []).append(
                GpuProcess(_int(labels.get("pid")), int(value))
            )
        elif name == "memtop_agent_info":
            agents[_int(labels.get("pid"))] = labels
        elif name == "memtop_steps_total":
            steps[_int(labels.get("pid"))] = int(value)
        elif name == "memtop_breakdown_bytes":
            device(labels).breakdown[labels.get("part", "other")] = int(value)
        elif (row := per_device.get(name)) is not None and row.fleet is not None:
            device(labels).put(*row.fleet, value)

    readings = []
    for uuid, gpu in gpus.items():
        listed = tuple(sorted(processes.get(uuid, []), key=lambda p: p.pid))
        figures: dict[str, Any] = {row.field: gpu.get(row.field) for row in per_gpu.values()}
        readings.append(
            DeviceReading(
                index=gpu.get("index", 0),
                uuid=uuid,
                name=gpu.get("name", ""),
                processes=listed,
                **figures,
                source=gpu.get("source", "nvml"),
            )
        )
    driver_devices = [r for r in readings if r.source != SOURCE_AGENT]
    if driver_devices:
        driver = DriverReading(
            True,
            tuple(sorted(driver_devices, key=lambda r: r.index)),
            source=driver_devices[0].source,
        )
    else:  # the host had no driver view: its GPUs come from the agents, as they did there
        driver = DriverReading(False, error="no NVML on this host", source=SOURCE_AGENT)

    polls = []
    breakdowns: dict[int, dict[str, Any]] = {}
    verdicts: dict[tuple[int, int], dict[str, float]] = {}
    jobs: dict[int, str] = {}
    for pid, labels in sorted(agents.items()):
        mine = sorted(
            (d for (p, _), d in devices.items() if p == pid and d.index is not None),
            key=lambda d: d.index or 0,
        )
        rank = labels.get("rank")
        hello = AgentHello(
            protocol=1,
            pid=pid,
            argv=tuple(labels.get("command", "").split()),
            python=labels.get("python", ""),
            torch=labels.get("torch") or None,
            allocator_conf=labels.get("allocator_conf", ""),
            devices=tuple(AgentDevice(d.index or 0, d.uuid, d.name, d.total) for d in mine),
            extra={
                "rank": _int(rank) if rank else None,
                "host": host,
                **hello_fields_from_labels(labels),
            },
        )
        jobs[pid] = labels.get("exported_job") or labels.get("job", "")
        try:
            state = AgentStatus(labels.get("state", "connected"))
        except ValueError:
            state = AgentStatus.INCONSISTENT
        sample = None
        if state == AgentStatus.CONNECTED:
            sample = AgentSample(
                time=stamp,
                step=steps.get(pid),
                devices=tuple(
                    AgentDeviceSample(d.index or 0, dict(d.stats), d.free, d.total) for d in mine
                ),
            )
            for d in mine:
                verdicts[(pid, d.index or 0)] = dict(d.verdict)
            parts = {str(d.index): dict(d.breakdown) for d in mine if d.breakdown}
            if parts:
                breakdowns[pid] = {"devices": parts}
        polls.append(AgentView(pid, state, hello, sample))
    return HostReading(
        host=host,
        time=stamp,
        driver=driver,
        polls=tuple(polls),
        breakdowns=breakdowns,
        verdicts=verdicts,
        jobs=jobs,
        instance=instance,
    )
