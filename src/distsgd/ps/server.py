"""Run one parameter-server task: bind (port 0 picks a free port), report the address, serve.

With a run secret every call must carry it (:class:`~distsgd.ps.auth.SecretInterceptor`); with a
:class:`~distsgd.transport.security.TlsConfig` the port is mutual TLS. See ``docs/security.md``.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from distsgd.ps.auth import SecretInterceptor
from distsgd.ps.rules import RuleFactory
from distsgd.ps.service import ParameterService
from distsgd.transport.client import GRPC_OPTIONS
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.transport.security import TlsConfig, exposure_warning, server_credentials
from distsgd.util import write_atomic

log = logging.getLogger(__name__)


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
) -> tuple[grpc.Server, str, ParameterService]:
    """Start serving one shard on ``address`` ("host:port", port 0 = any free port).

    Returns the server, the address it really listens on, and the service (for in-process tests).
    Pulls that wait for a synchronous step hold a thread each, hence the generous pool.
    ``secret``: every call must carry this run secret (None = no check; "" is refused as a
    mistake). ``tls``: listen with mutual TLS instead of plaintext. ``checkpoint_dir`` and
    ``restore`` go to :class:`ParameterService` (where Checkpoint writes; a shard file to start
    from).
    """
    host, _, port = address.rpartition(":")
    interceptors: list[grpc.ServerInterceptor[Any, Any]] = (
        [SecretInterceptor(secret)] if secret is not None else []
    )
    service = ParameterService(
        shard_index=shard_index,
        rule_factory=rule_factory,
        checkpoint_dir=checkpoint_dir,
        restore=restore,
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_threads),
        options=GRPC_OPTIONS,
        interceptors=interceptors,
    )
    pb_grpc.add_ParameterServerServicer_to_server(service, server)
    try:
        if tls is not None:
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpcio raises on a busy or invalid address
        raise OSError(
            f"cannot listen on {address}: {exc}; pick a free port or use port 0"
        ) from None
    if bound == 0:
        raise OSError(f"cannot listen on {address}; pick a free port or use port 0")
    server.start()
    return server, f"{host}:{bound}", service


def serve(
    *,
    address: str,
    shard_index: int,
    rule_factory: RuleFactory,
    address_file: Path | None = None,
    stop: threading.Event | None = None,
    secret: str | None = None,
    tls: TlsConfig | None = None,
    checkpoint_dir: Path | None = None,
    restore: Path | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set); shutdown always runs.

    ``secret``, ``tls``, ``checkpoint_dir`` and ``restore`` as for :func:`start_server`. A warning
    is logged when the address is reachable from other machines (not loopback) without TLS.
    """
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    server, bound, service = start_server(
        address=address,
        shard_index=shard_index,
        rule_factory=rule_factory,
        secret=secret,
        tls=tls,
        checkpoint_dir=checkpoint_dir,
        restore=restore,
    )
    try:
        log.info(
            "parameter server ps%d listening on %s (%s, %s)",
            shard_index,
            bound,
            "run secret required" if secret is not None else "no run secret",
            "mutual TLS" if tls is not None else "plaintext",
        )
        warning = exposure_warning(bound, secret=secret, tls=tls)
        if warning is not None:
            log.warning("%s", warning)
        if address_file is not None:
            write_atomic(address_file, bound + "\n")
        stop.wait()
        log.info("parameter server ps%d stopping", shard_index)
    finally:
        server.stop(grace=1.0).wait(timeout=5.0)
        service.close()
