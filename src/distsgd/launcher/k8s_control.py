"""``distsgd server --job control``: the run control as a task of its own, the control pod.

A JobSet rendered by ``distsgd k8s render`` has a replicated job ``control`` of one pod that
runs it. The run folder (``metrics.jsonl``, ``result.json``, ``final_model.pt``, setup-error
records, the servers' addresses, TensorBoard events) is assembled on that pod's volume from
what the servers and workers send over the network (:class:`~distsgd.launcher.control.
ControlServer`, ``RunControl`` in the ``.proto``; the tasks are given ``--control``), so no
other pod needs that volume: each keeps its checkpoints and write-ahead log on its own storage.

It listens on a fixed address (the pod's port, on every interface of the pod), requires the run
secret (every call carries it), and runs until SIGINT or SIGTERM: JobSet deletes its Job once
the workers have completed, after the chief has put its result (a put waits for its answer).
Torch-free.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from distsgd.launcher.control import ControlServer
from distsgd.transport.security import TRUSTED_NETWORK_ENV, is_loopback, trusted_network
from distsgd.util import private_dir, write_atomic
from distsgd.util.signals import stopping

__all__ = ["serve_control", "split_host_port"]

log = logging.getLogger(__name__)


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); a one-line ValueError naming the form otherwise."""
    host, _, port = address.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--address {address!r}: write HOST:PORT, e.g. 0.0.0.0:2222")
    return host.strip("[]"), int(port)


def serve_control(
    run_dir: Path,
    *,
    address: str,
    secret: str,
    address_file: Path | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve the run control of ``run_dir`` on ``address`` (port 0: any; the bound address goes
    to ``address_file``), requiring ``secret``, until SIGINT/SIGTERM or ``stop``."""
    stop = stop or threading.Event()
    with stopping(stop):
        host, port = split_host_port(address)
        private_dir(run_dir)
        server = ControlServer(run_dir, host=host, port=port, secret=secret)
        try:
            log.info("run control on %s for %s (run secret required)", server.address, run_dir)
            if not is_loopback(host) and not trusted_network():
                log.warning(
                    "run control listening on non-loopback %s without TLS: the run secret and the "
                    "run folder's files cross the network in plaintext; listen on a network meant "
                    "for this run only (%s=1 says it is)",
                    server.address,
                    TRUSTED_NETWORK_ENV,
                )
            if address_file is not None:
                write_atomic(address_file, server.address + "\n")
            stop.wait()
            log.info("run control stopping (%d bytes written for tasks)", server.service.written)
        finally:
            server.close()
