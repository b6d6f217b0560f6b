"""Run one parameter-server task: bind (port 0 picks a free port), report the address, serve."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc

from distsgd.ps.rules import RuleFactory
from distsgd.ps.service import ParameterService
from distsgd.transport.client import GRPC_OPTIONS
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.util import write_atomic

log = logging.getLogger(__name__)


def start_server(
    *, address: str, shard_index: int, rule_factory: RuleFactory, max_threads: int = 64
) -> tuple[grpc.Server, str, ParameterService]:
    """Start serving one shard on ``address`` ("host:port", port 0 = any free port).

    Returns the server, the address it really listens on, and the service (for in-process tests).
    Pulls that wait for a synchronous step hold a thread each, hence the generous pool.
    """
    host, _, port = address.rpartition(":")
    service = ParameterService(shard_index=shard_index, rule_factory=rule_factory)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads), options=GRPC_OPTIONS)
    pb_grpc.add_ParameterServerServicer_to_server(service, server)
    try:
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
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set); shutdown always runs."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    server, bound, _ = start_server(
        address=address, shard_index=shard_index, rule_factory=rule_factory
    )
    try:
        log.info("parameter server ps%d listening on %s", shard_index, bound)
        if address_file is not None:
            write_atomic(address_file, bound + "\n")
        stop.wait()
        log.info("parameter server ps%d stopping", shard_index)
    finally:
        server.stop(grace=1.0).wait(timeout=5.0)
