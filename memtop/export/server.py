"""`memtop export`: sample every round, publish one observation, serve it on /metrics.

The scrape never does I/O of its own: the loop here samples (NVML and every agent) at the
interval and hands the newest observation to the collector; a scrape renders what it holds.

Security: loopback by default.  Metrics carry process ids, command lines and memory figures of
the host, so listening beyond loopback is opt-in (`--listen 0.0.0.0:9482`, with a warning), and a
web config file adds TLS and HTTP basic auth:

    {"tls": {"cert_file": "/etc/memtop/cert.pem", "key_file": "/etc/memtop/key.pem"},
     "basic_auth": {"prometheus": "sha256:<hex digest of the password>"}}

Whoever reaches the port gets at most MAX_CONNECTIONS handler threads (717 slow connections made
718 threads) and HEADER_DEADLINE_S to finish the TLS handshake and the request's headers, after
which basic auth is checked; when all are taken, the connection that has waited longest for its
headers makes way, so a scrape that sends its request at once is served through a flood of slow
ones.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import ipaddress
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import field
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from memtop import protocol
from memtop.base import untrusted
from memtop.base.errors import MemtopError
from memtop.base.records import record
from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.engine.scope import Scope
from memtop.export.metrics import ObservationCollector
from memtop.export.text import CONTENT_TYPE

DEFAULT_LISTEN = "127.0.0.1:9482"

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class ExportError(MemtopError):
    """A bad --listen or web config: one line for the user."""


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[v6]:PORT` or `:PORT` (loopback)."""
    host, sep, port_text = text.rpartition(":")
    port = protocol.decimal(port_text)
    if not sep or port is None or port > 65535:
        raise ExportError(f"--listen wants HOST:PORT, got {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


@record(frozen=True)
class WebConfig:
    cert_file: Path | None = None
    key_file: Path | None = None
    users: dict[str, str] = field(default_factory=dict)  # name -> "sha256:<hex>"

    @property
    def tls(self) -> bool:
        return self.cert_file is not None


MAX_WEB_CONFIG_BYTES = 64 << 10


def load_web_config(path: Path) -> WebConfig:
    try:
        data = untrusted.load_json_file(path, MAX_WEB_CONFIG_BYTES)
    except OSError as exc:
        raise ExportError(f"cannot read the web config {path}: {exc.strerror}") from None
    except untrusted.UntrustedInput as exc:  # a FIFO, /dev/zero, deep nesting, not JSON
        raise ExportError(f"the web config {path} {exc}") from None
    if not isinstance(data, dict) or set(data) - {"tls", "basic_auth"}:
        raise ExportError(f"the web config {path} may hold only 'tls' and 'basic_auth'")
    tls = data.get("tls") or {}
    users = data.get("basic_auth") or {}
    if not isinstance(tls, dict) or not isinstance(users, dict):
        raise ExportError(f"the web config {path}: 'tls' and 'basic_auth' are objects")
    for name, digest in users.items():
        if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 71:
            raise ExportError(
                f"the web config {path}: the password of {name!r} must be 'sha256:<64 hex>'"
            )
    cert, key = tls.get("cert_file"), tls.get("key_file")
    if bool(cert) != bool(key):
        raise ExportError(f"the web config {path}: TLS needs both cert_file and key_file")
    return WebConfig(
        cert_file=Path(cert) if cert else None,
        key_file=Path(key) if key else None,
        users={str(k): v.lower() for k, v in users.items()},
    )


def with_basic_auth(app: WsgiApp, users: dict[str, str]) -> WsgiApp:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION", "")
        if header.startswith("Basic ") and _allowed(header[6:], users):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", 'Basic realm="memtop"'), ("Content-Type", "text/plain")],
        )
        return [b"unauthorized\n"]

    return guarded


def _allowed(encoded: str, users: dict[str, str]) -> bool:
    try:
        name, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return False
    expected = users.get(name)
    digest = "sha256:" + hashlib.sha256(password.encode()).hexdigest()
    # Compare in constant time, and as long for unknown names as for known ones.
    return hmac.compare_digest(digest, expected or "sha256:" + "0" * 64) and expected is not None


MAX_CONNECTIONS = 32  # handler threads: Prometheus scrapes over one; a few curls beside it
HEADER_DEADLINE_S = 5.0  # from accept to the end of the request's headers, TLS handshake included


class _Gate:
    """The connections being served, and those still sending their headers with the time by
    which they must be done; one reaper thread shuts the late ones."""

    def __init__(self, limit: int, deadline_s: float) -> None:
        self.limit = limit
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._active = 0
        self._waiting: OrderedDict[Any, float] = OrderedDict()  # oldest first
        self._stopped = threading.Event()

    def admit(self, sock: Any) -> bool:
        """Whether to serve `sock`: yes while under the limit; at the limit, the connection
        that has waited longest for its headers is shut to make way; past twice the limit
        (evicted threads not gone yet), no."""
        with self._lock:
            if self._active >= self.limit and self._waiting:
                oldest, _ = self._waiting.popitem(last=False)
                _shut(oldest)
            if self._active >= 2 * self.limit:
                return False
            self._active += 1
            self._waiting[sock] = time.monotonic() + self.deadline_s
            return True

    def headers_done(self, sock: Any) -> None:
        with self._lock:
            self._waiting.pop(sock, None)

    def release(self, sock: Any) -> None:
        with self._lock:
            self._waiting.pop(sock, None)
            self._active -= 1

    def reap(self) -> None:
        while not self._stopped.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [sock for sock, until in self._waiting.items() if until <= now]
                for sock in late:
                    del self._waiting[sock]
            for sock in late:
                _shut(sock)  # its handler's read returns: the thread ends

    def stop(self) -> None:
        self._stopped.set()


def _shut(sock: Any) -> None:
    with contextlib.suppress(OSError, ValueError):
        sock.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False  # stop() never waits on a client
    request_queue_size = 128  # a burst of connects waits in the kernel, not in SYN retries
    allow_reuse_address = True
    gate: _Gate  # set by Exporter.start_http, before serve_forever

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.gate.admit(request):
            self.shutdown_request(request)  # in the accept thread: no handshake, no reply
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread: no slot either
            self.gate.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gate.release(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up or speaks no TLS is its own problem: no traceback


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = 10.0  # per read and write, once the headers are in

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.gate.headers_done(self.request)  # type: ignore[attr-defined]
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Exporter:
    """The sampler, one observer, the collector and the HTTP server of `memtop export`."""

    def __init__(
        self,
        sampler: Sampler,
        listen: str = DEFAULT_LISTEN,
        *,
        host: str | None = None,
        job: str | None = None,
        web_config: WebConfig | None = None,
        scope: Scope | None = None,
    ) -> None:
        self.sampler = sampler
        self.scope = scope or Scope()  # --only, --user, --pid: what is exported
        self.address = parse_listen(listen)
        self.observer = Observer(sampler.store, host=host)
        self.collector = ObservationCollector(host=host, job=job)
        self.web_config = web_config or WebConfig()
        self.rounds = 0
        self._stop = threading.Event()
        self._httpd: WSGIServer | None = None

    @property
    def exposed(self) -> bool:
        return not is_loopback(self.address[0])

    def start_http(self) -> tuple[str, int]:
        """Bind and serve on a daemon thread; the bound (host, port)."""
        app: WsgiApp = self._app
        if self.web_config.users:
            app = with_basic_auth(app, self.web_config.users)
        host, port = self.address
        try:
            server_class: type[_Server] = _Server6 if ":" in host else _Server
            httpd = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise ExportError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        httpd.gate = _Gate(MAX_CONNECTIONS, HEADER_DEADLINE_S)  # type: ignore[attr-defined]
        if self.web_config.tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_cert_chain(
                    str(self.web_config.cert_file), str(self.web_config.key_file)
                )
            except (OSError, ssl.SSLError) as exc:
                httpd.server_close()
                raise ExportError(f"cannot load the TLS certificate: {exc}") from None
            # The handshake on the handler's thread, not in accept(): a client that connects
            # and says nothing must not stall the server for everyone else.
            httpd.socket = context.wrap_socket(
                httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._httpd = httpd
        threading.Thread(target=httpd.serve_forever, name="memtop-http", daemon=True).start()
        threading.Thread(target=httpd.gate.reap, name="memtop-http-reaper", daemon=True).start()  # type: ignore[attr-defined]
        bound = httpd.server_address
        return str(bound[0]), int(bound[1])

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if path == "/metrics":
            if not self.collector.ready:  # up=0 until the first round, not an empty success
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"memtop export: the first sampling round is not done yet\n"]
            body = self.collector.body()
            start_response(
                "200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]
            )
            return [body] if environ["REQUEST_METHOD"] == "GET" else [b""]
        if path == "/":
            page = b'<html><body>memtop exporter: <a href="/metrics">/metrics</a></body></html>\n'
            start_response("200 OK", [("Content-Type", "text/html")])
            return [page]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def round(self) -> None:
        self.sampler.sample_once()
        self.collector.observe(self.scope.apply(self.observer.publish()))
        # Render here, once per round, so that a scrape only copies bytes (the 5 ms budget of
        # DESIGN §9 holds whatever the number of agents; rendering 500 samples costs ~4 ms).
        self.collector.body()
        self.rounds += 1

    def run(self, interval: float) -> None:
        """Sample and publish every `interval` seconds until `stop()`."""
        while not self._stop.is_set():
            deadline = time.monotonic() + interval
            try:
                self.round()
            except Exception as exc:  # keep serving the last observation; say what happened
                self.sampler.store.note(f"exporter: {type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.gate.stop()  # type: ignore[attr-defined]
            self._httpd.shutdown()
            self._httpd.server_close()
