"""The launcher's metrics endpoint: ``GET /metrics`` in Prometheus's text format, read from the
run folder's ``metrics.jsonl`` when it is asked (a scrape), never in between.

It listens on 127.0.0.1 and a free port unless ``--metrics-address HOST:PORT`` says otherwise
(``off``: not at all), and writes its real address to ``RUN/metrics.address``. It answers
``GET`` and ``HEAD`` of ``/metrics`` and nothing else (docs/security.md, "Metrics endpoint"):
another method is 405, another path 404, a request line or headers over their limits 414 or
431, a ``Host`` that is neither an IP literal nor ``localhost`` of the bound address 421 (a
web page whose name was rebound to 127.0.0.1 cannot read it). No request body is read, and no
request changes anything.
"""

from __future__ import annotations

import http.client
import http.server
import ipaddress
import logging
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Any

from distsgd.control.folder import METRICS_FILE
from distsgd.control.prometheus import CONTENT_TYPE, render
from distsgd.control.run_view import LiveView
from distsgd.transport.security import is_loopback
from distsgd.util import write_atomic

log = logging.getLogger(__name__)

ADDRESS_FILE = "metrics.address"
"""Where in the run folder the endpoint's address (``host:port``) is written once it listens."""
DEFAULT_ADDRESS = "127.0.0.1:0"
"""``--metrics-address``'s default: loopback, a free port."""
OFF = "off"
"""``--metrics-address off``: no endpoint."""
MAX_REQUEST_LINE = 1024
"""Bytes a request line may have (longer: 414)."""
MAX_HEADER_BYTES = 8192
"""Bytes all headers together may have (more: 431)."""
SOCKET_TIMEOUT = 5.0
"""Seconds a connection may be silent, and the most its request may take to arrive."""
MAX_CONNECTIONS = 8
"""Connections served at once; one more is closed unanswered."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port); ValueError naming the fix."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    fix = "give HOST:PORT, e.g. 127.0.0.1:9100 (port 0: a free one), or off"
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--metrics-address {text!r}: {fix}")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"--metrics-address {text!r}: HOST must be an IP address; {fix}"
            ) from None
    return host, int(port)


class _Capped:
    """A request's reader that raises ``LineTooLong`` (the stdlib answers 431) once its headers
    pass :data:`MAX_HEADER_BYTES` or :data:`SOCKET_TIMEOUT` seconds."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.left = MAX_HEADER_BYTES
        self.deadline = time.monotonic() + SOCKET_TIMEOUT

    def readline(self, limit: int = -1) -> bytes:
        if time.monotonic() > self.deadline:
            raise TimeoutError("headers too slow")
        line: bytes = self.raw.readline(self.left + 1 if limit < 0 else min(limit, self.left + 1))
        self.left -= len(line)
        if self.left < 0:
            raise http.client.LineTooLong("headers")
        return line


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = SOCKET_TIMEOUT
    server_version = "distsgd"
    sys_version = ""

    def handle_one_request(self) -> None:
        """One request per connection; its line and headers capped, its body never read."""
        self.close_connection = True
        try:
            line = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if len(line) > MAX_REQUEST_LINE:
                self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
                self.send_error(414)
                return
            if not line:
                return
            self.raw_requestline = line
            self.rfile = _Capped(self.rfile)  # type: ignore[assignment]
            if not self.parse_request():
                return
            self._answer()
        except TimeoutError:
            return

    def _answer(self) -> None:
        if self.command not in ("GET", "HEAD"):
            self.refused_method = True  # its answer says which are allowed
            self.send_error(405)
            return
        if not self.server.host_allowed(self.headers.get("Host")):
            self.send_error(421, "Host must be an IP literal or localhost of this address")
            return
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404)
            return
        body = self.server.exposition().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def end_headers(self) -> None:
        if getattr(self, "refused_method", False):
            self.send_header("Allow", "GET, HEAD")
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics endpoint: %s - %s", self.address_string(), format % args)


class MetricsServer(http.server.ThreadingHTTPServer):
    """The HTTP server of one run's :class:`MetricsEndpoint`."""

    daemon_threads = True
    block_on_close = False
    timeout = 0.0
    """``handle_request`` is called once the socket is readable: it never waits."""

    def __init__(self, address: tuple[str, int], live: LiveView) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.live = live
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)
        self.host, self.port = str(self.server_address[0]), int(self.server_address[1])
        """The address it listens on (its port the one it got)."""

    def exposition(self) -> str:
        with self._lock:
            return render(self.live.refresh())

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's ``Host`` names this server: an IP literal it listens on (any,
        on a wildcard address), or ``localhost`` where it listens on loopback."""
        if not header:
            return False
        if header.startswith("["):  # [v6]:port
            host = header[1 : header.find("]")]
        else:  # name:port, v4:port, or a name or address alone
            host = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
        host = host.lower()
        bound = ipaddress.ip_address(self.host)
        if host == "localhost":
            return bound.is_loopback or bound.is_unspecified
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name: what a rebound DNS name would send
        return ip == bound or bound.is_unspecified or (ip.is_loopback and bound.is_loopback)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed unanswered
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics endpoint: a request from %s failed", client_address, exc_info=True)


class MetricsEndpoint:
    """``GET /metrics`` of ``run_dir``'s metrics on ``address`` (``host:port``), served by
    daemon threads; :attr:`address` is where it listens. :meth:`close` stops it."""

    def __init__(self, run_dir: Path, address: str = DEFAULT_ADDRESS) -> None:
        host, port = parse_address(address)
        host = "127.0.0.1" if host == "localhost" else host
        live = LiveView(Path(run_dir) / METRICS_FILE, run=Path(run_dir).resolve().name)
        try:
            self.server = MetricsServer((host, port), live)
        except OSError as exc:
            raise ValueError(
                f"cannot listen on {address} for the metrics endpoint ({exc.strerror or exc}); "
                "give a free port with --metrics-address HOST:PORT, or --metrics-address off"
            ) from None
        bound_host, bound_port = self.server.host, self.server.port
        self.address = (
            f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        )
        self._wake, self._woken = socket.socketpair()
        self.thread = threading.Thread(target=self._serve, name="metrics-endpoint", daemon=True)
        self.thread.start()
        if not is_loopback(bound_host):
            log.warning(
                "metrics endpoint on %s beyond loopback: anyone who can reach it reads the run's "
                "metrics (no secret, no TLS); bind 127.0.0.1 unless the network is trusted",
                self.address,
            )

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def _serve(self) -> None:
        """Accept connections until :meth:`close`: asleep in ``select`` in between (no
        polling), each connection handed to a thread of its own."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.server, selectors.EVENT_READ)
            selector.register(self._woken, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._woken:
                        return
                    self.server.handle_request()  # ready: accepts without waiting

    def close(self) -> None:
        """Stop listening (a request being answered still gets its answer)."""
        self._wake.send(b"x")
        self.thread.join(timeout=5)
        self.server.server_close()
        self._wake.close()
        self._woken.close()


def start_endpoint(run_dir: Path, address: str, note: Any) -> MetricsEndpoint | None:
    """The run's endpoint on ``address`` (``off``: None), its address written to
    ``RUN/metrics.address`` and said by ``note`` (the console's)."""
    if address == OFF:
        return None
    endpoint = MetricsEndpoint(run_dir, address)
    write_atomic(Path(run_dir) / ADDRESS_FILE, endpoint.address + "\n")
    note(f"[distsgd] metrics for Prometheus at {endpoint.url} (written to {ADDRESS_FILE})")
    return endpoint
