"""The launcher's metrics endpoint (launcher/metrics_endpoint.py): what it answers, what it
refuses (docs/security.md, "Metrics endpoint"), each on a free loopback port; and a real local
run that writes ``metrics.address`` and answers with its workers."""

from __future__ import annotations

import logging
import signal
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import synthetic_run
from conftest import SCRIPTS, wait_for

from distsgd.control.prometheus import CONTENT_TYPE
from distsgd.launcher.config import Hosting
from distsgd.launcher.metrics_endpoint import (
    ADDRESS_FILE,
    MAX_HEADER_BYTES,
    MAX_REQUEST_LINE,
    MetricsEndpoint,
    MetricsServer,
    start_endpoint,
)


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[MetricsEndpoint]:
    synthetic_run.write(tmp_path / "run", synthetic_run.lines())
    served = MetricsEndpoint(tmp_path / "run", "127.0.0.1:0")
    try:
        yield served
    finally:
        served.close()


def _ask(endpoint: MetricsEndpoint, request: bytes) -> tuple[int, bytes]:
    """The status code and the whole answer to ``request``, sent raw."""
    with socket.create_connection((endpoint.server.host, endpoint.server.port), timeout=10) as s:
        s.sendall(request)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:  # closed with the unread rest of a refused request
            assert answer, "reset before any answer"
    return int(answer.split(b" ", 2)[1]), answer


def _get(path: str = "/metrics", host: str = "127.0.0.1", method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


def test_get_metrics_answers_the_exposition(endpoint: MetricsEndpoint) -> None:
    with urllib.request.urlopen(endpoint.url, timeout=10) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"] == CONTENT_TYPE
        text = answer.read().decode()
    assert 'distsgd_last_step_timestamp_seconds{run="run",task="worker0"} ' in text
    code, head = _ask(endpoint, _get(method="HEAD", host=f"localhost:{endpoint.server.port}"))
    assert code == 200 and head.endswith(b"\r\n\r\n")  # headers only


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        (b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\nstop", 405),
        (_get(method="DELETE"), 405),
        (_get("/"), 404),
        (_get("/metrics/../secret"), 404),
        (_get(host="evil.example"), 421),  # a rebound DNS name
        (_get(host="evil.example:8080"), 421),
        (_get(host="10.0.0.1"), 421),  # not this address
        (b"GET /metrics HTTP/1.1\r\n\r\n", 421),  # no Host
        (_get("/" + "a" * MAX_REQUEST_LINE), 414),
        (_get().replace(b"\r\n\r\n", b"\r\nX: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n"), 431),
        (_get().replace(b"\r\n\r\n", b"\r\n" + b"X: a\r\n" * 2000 + b"\r\n"), 431),
    ],
)
def test_refusals(endpoint: MetricsEndpoint, request_bytes: bytes, code: int) -> None:
    got, answer = _ask(endpoint, request_bytes)
    assert got == code, answer[:200]
    assert b"distsgd_" not in answer
    if code == 405:
        assert b"\r\nAllow: GET, HEAD\r\n" in answer


def test_which_hosts_name_the_address() -> None:
    allowed = MetricsServer.host_allowed
    loopback, wildcard = SimpleNamespace(host="127.0.0.1"), SimpleNamespace(host="0.0.0.0")
    assert allowed(loopback, "127.0.0.1:9100") and allowed(loopback, "LOCALHOST")  # type: ignore[arg-type]
    assert allowed(loopback, "127.0.0.2") and not allowed(loopback, "[::2]:1")  # type: ignore[arg-type]
    assert allowed(SimpleNamespace(host="::1"), "[::1]:9100")  # type: ignore[arg-type]
    assert allowed(wildcard, "10.1.2.3:9100") and not allowed(wildcard, "box.example")  # type: ignore[arg-type]
    assert not allowed(loopback, "") and not allowed(loopback, None)  # type: ignore[arg-type]


def test_addresses_are_checked_and_a_busy_port_named(tmp_path: Path) -> None:
    assert Hosting(metrics_address="off").metrics_address == "off"
    for bad in ("9100", "host.example:9100", "127.0.0.1:http", "127.0.0.1:70000", ":9100"):
        with pytest.raises(ValueError, match=r"--metrics-address .*HOST:PORT"):
            Hosting(metrics_address=bad)
    assert start_endpoint(tmp_path, "off", print) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*off$"):
            MetricsEndpoint(tmp_path, f"127.0.0.1:{port}")


def test_start_writes_the_address_and_says_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    said: list[str] = []
    with caplog.at_level(logging.WARNING):
        served = start_endpoint(tmp_path, "localhost:0", said.append)
    assert served is not None
    try:
        assert (tmp_path / ADDRESS_FILE).read_text() == served.address + "\n"
        assert served.address.startswith("127.0.0.1:") and served.url in said[0]
        assert not caplog.records  # loopback: no warning
        with urllib.request.urlopen(served.url, timeout=10) as answer:
            assert b"distsgd_up" in answer.read()  # no metrics yet: still an answer
    finally:
        served.close()
    with pytest.raises(OSError):
        socket.create_connection((served.server.host, served.server.port), timeout=5)


@pytest.mark.slow
def test_a_local_run_serves_its_workers(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    args = ["run", "--workers", "2", "--scheme", "hogwild", "--quiet", "--run-dir", str(run_dir)]
    args += ["--checkpoint-every", "0"]  # Ctrl-C stops at once (nothing to save)
    launcher = spawn([*args, str(SCRIPTS / "blobs.py"), "--steps", "2000", "--slow", "0.02"])
    assert wait_for((run_dir / ADDRESS_FILE).exists, 60), "no metrics.address"
    url = f"http://{(run_dir / ADDRESS_FILE).read_text().strip()}/metrics"
    seen = ""

    def both_workers() -> bool:
        nonlocal seen
        with urllib.request.urlopen(url, timeout=10) as answer:
            seen = answer.read().decode()
        return all(
            f'distsgd_last_step_timestamp_seconds{{run="run",task="worker{i}"}}' in seen
            for i in (0, 1)
        )

    assert wait_for(both_workers, 60, interval=0.3), seen
    launcher.send_signal(signal.SIGINT)  # the run has shown what it serves: stop it (its PID)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, out[-3000:]
    assert "metrics for Prometheus at http://127.0.0.1:" in out
    with pytest.raises(OSError):  # gone with the run
        urllib.request.urlopen(url, timeout=5)
