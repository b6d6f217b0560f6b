"""Run one parameter-server task: bind (port 0 picks a free port), report the address, serve.

With a run secret every call must carry it (:class:`~distsgd.ps.auth.SecretInterceptor`); with a
:class:`~distsgd.transport.security.TlsConfig` the port is mutual TLS. See ``docs/security.md``.

The port is exclusive: servers are started without ``SO_REUSEPORT``, so a second server on a
port in use fails (:class:`OSError`, one line) instead of sharing it. :func:`serve` stops within
a second of SIGTERM or SIGINT: waiting pulls are woken and answered UNAVAILABLE first.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import grpc

from distsgd.ps import handlers
from distsgd.ps.auth import SecretInterceptor
from distsgd.ps.membership import DEFAULT_EVICT_AFTER
from distsgd.ps.rules import RuleFactory
from distsgd.ps.service import ParameterService
from distsgd.transport.client import GRPC_OPTIONS
from distsgd.transport.security import (
    TlsConfig,
    exposure_warning,
    server_credentials,
    trusted_network,
)
from distsgd.util import write_atomic
from distsgd.util.probe import start_probe
from distsgd.util.signals import stopping

if TYPE_CHECKING:
    from typing import Unpack

log = logging.getLogger(__name__)

SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
"""gRPC server options: the clients' message limits, and no SO_REUSEPORT (ports are exclusive)."""

STOP_GRACE_SECONDS = 0.5
"""How long :func:`stop_server` lets calls in flight finish before cancelling them."""


def _port_in_use(host: str, port: int) -> bool:
    """Whether some socket already listens on ``host:port`` (a plain bind fails EADDRINUSE).

    Checked before gRPC binds, so that a busy port is one distsgd message, not a gRPC C-core log
    line. The probe sets SO_REUSEADDR as gRPC does, so a port in TIME_WAIT counts as free.
    """
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False  # gRPC reports an unresolvable host itself
    for family, kind, proto, _, sockaddr in infos:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # e.g. no IPv6 on this machine
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


class ServerArgs(TypedDict, total=False):
    """The keywords :func:`serve` passes on to :func:`start_server` as they are."""

    secret: str | None
    tls: TlsConfig | None
    checkpoint_dir: Path | None
    restore: Path | None
    max_workers: int
    evict_after: float
    wal_dir: Path | None
    inject_delay: float


def start_server(
    *,
    address: str,
    shard_index: int,
    rule_factory: RuleFactory,
    max_threads: int = 64,
    secret: str | None = None,
    tls: TlsConfig | None = None,
    checkpoint_dir: Path | None = None,
    restore: Path | None = None,
    max_workers: int = 0,
    evict_after: float = DEFAULT_EVICT_AFTER,
    wal_dir: Path | None = None,
    inject_delay: float = 0.0,
) -> tuple[grpc.Server, str, ParameterService]:
    """Start serving one shard on ``address`` ("host:port", port 0 = any free port).

    Returns the server, the address it really listens on, and the service (for in-process tests;
    stop both with :func:`stop_server`). Pulls that wait for a synchronous step hold a thread
    each, hence the generous pool; at most three quarters of ``max_threads`` wait at once (one
    more is answered RESOURCE_EXHAUSTED and retried by the client), so the other quarter is
    always free for pushes, Info and Leave. ``secret``: every call must carry this run secret
    (None = no check; "" or fewer than 32 characters is refused as a mistake). ``tls``: listen
    with mutual TLS instead of plaintext. ``checkpoint_dir`` and ``restore`` go to
    :class:`ParameterService` (where Checkpoint writes; a shard file to start from), and so do
    ``max_workers`` and ``evict_after`` (membership: see :mod:`distsgd.ps.membership`), and
    ``wal_dir`` (the shard's write-ahead log: see :mod:`distsgd.ps.wal`). ``inject_delay``:
    seconds every pull and push waits before its answer (``--inject-fault delay:ps:N=...``,
    a slow server; 0: none).

    A port in use raises :class:`OSError` with a one-line message.
    """
    if max_threads < 2:
        raise ValueError(f"max_threads must be at least 2, got {max_threads}")
    host, _, port = address.rpartition(":")
    if port.isdigit() and int(port) != 0 and _port_in_use(host, int(port)):
        raise OSError(
            f"cannot listen on {address}: the port is in use (another distsgd server?); "
            "stop that process, or pick a free port (0 = any free port)"
        )
    interceptors: list[grpc.ServerInterceptor[Any, Any]] = (
        [SecretInterceptor(secret)] if secret is not None else []
    )
    service = ParameterService(
        shard_index=shard_index,
        rule_factory=rule_factory,
        checkpoint_dir=checkpoint_dir,
        restore=restore,
        max_waiting_pulls=max(1, max_threads * 3 // 4),
        host=host.strip("[]"),
        tls=tls is not None,
        max_workers=max_workers,
        evict_after=evict_after,
        wal_dir=wal_dir,
    )
    service.data.set_delay(inject_delay)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=f"ps{shard_index}"),
        options=SERVER_OPTIONS,
        interceptors=interceptors,
    )
    handlers.add_to_server(service, server)  # unparseable requests: INVALID_ARGUMENT
    try:
        if tls is not None:
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises on a busy or invalid address
        service.close()
        raise OSError(
            f"cannot listen on {address}: the address is invalid or in use; "
            "pick a free port (0 = any free port) on an address of this machine"
        ) from None
    if bound == 0:
        service.close()
        raise OSError(f"cannot listen on {address}; pick a free port or use port 0")
    server.start()
    return server, f"{host}:{bound}", service


def stop_server(
    server: grpc.Server, service: ParameterService, grace: float = STOP_GRACE_SECONDS
) -> None:
    """Stop quickly: wake waiting pulls (they answer UNAVAILABLE), let calls in flight finish
    for ``grace`` seconds, then cancel the rest. Returns within about ``grace`` + 0.5 s."""
    service.close()
    server.stop(grace=grace).wait(timeout=grace + 0.5)
    shard = service.shard
    if shard is not None and shard.wal is not None:
        shard.wal.close()


def serve(
    *,
    address: str,
    shard_index: int,
    rule_factory: RuleFactory,
    address_file: Path | None = None,
    stop: threading.Event | None = None,
    announce: Callable[[str], None] | None = None,
    **args: Unpack[ServerArgs],
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set); shutdown always runs.

    The bound address goes to ``address_file`` and to ``announce`` (the launcher's run
    control) once the server listens.

    ``address``, ``shard_index``, ``rule_factory`` and ``args`` (``secret``, ``tls``,
    ``checkpoint_dir``, ``restore``, ``max_workers``, ``evict_after``, ``wal_dir``,
    ``inject_delay``) go to
    :func:`start_server`. A warning is logged on any address without a run secret (on loopback
    every local user can connect), and on a non-loopback one without TLS (unless it has a
    secret and ``DISTSGD_TRUSTED_NETWORK`` is 1). Returns within a second of ``stop`` (or the
    signal).
    """
    stop = stop or threading.Event()
    with stopping(stop):
        server, bound, service = start_server(
            address=address, shard_index=shard_index, rule_factory=rule_factory, **args
        )
        secret, tls = args.get("secret"), args.get("tls")
        probe = start_probe(f"ps{shard_index}")  # distsgd doctor's way in ($DISTSGD_DOCTOR_DIR)
        if probe is not None:
            probe.add("server", lambda: {"address": bound, **service.diagnose()})
        try:
            log.info(
                "parameter server ps%d listening on %s (%s, %s)",
                shard_index,
                bound,
                "run secret required" if secret is not None else "no run secret",
                "mutual TLS" if tls is not None else "plaintext",
            )
            warning = exposure_warning(bound, secret=secret, tls=tls)
            if warning is not None and not (secret and trusted_network()):
                log.warning("%s", warning)
            if address_file is not None:
                write_atomic(address_file, bound + "\n")
            if announce is not None:
                announce(bound)
            stop.wait()
            log.info("parameter server ps%d stopping", shard_index)
        finally:
            if probe is not None:
                probe.close()
            stop_server(server, service)
