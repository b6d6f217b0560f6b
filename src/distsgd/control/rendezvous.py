"""The rendezvous store of a collective run: a torch.distributed ``TCPStore`` that listens on
the given host only. The launcher hosts it for ``distsgd run``; otherwise the chief worker does
(the runtime's ``Collective``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::"})
"""Host names that mean every interface: never bound as given (loopback instead)."""


def host_store(
    host: str, timeout: timedelta, *, port: int = 0, world_size: int | None = None
) -> tuple[Any, int]:
    """A torch.distributed ``TCPStore`` server listening on ``host:port`` only, and its port.

    ``TCPStore`` itself listens on every interface whatever host it is given, so the socket is
    bound here and handed over (``master_listen_fd``); port 0 picks a free one. torch is
    imported here, by the process that hosts the store.
    """
    import torch.distributed as dist

    name = host.strip().strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ValueError(
            f"rendezvous host {host!r} does not resolve ({exc.strerror}); "
            "give an IP address or a name of this machine"
        ) from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno,
            f"the rendezvous store cannot listen on {host}:{port} ({exc.strerror}); "
            "free the port or give another address",
        ) from exc
    bound = int(sock.getsockname()[1])
    fd = sock.detach()  # the store owns the socket from here on and closes it
    try:
        store = dist.TCPStore(
            name if name not in WILDCARDS else "127.0.0.1",
            bound,
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    log.info("rendezvous store listening on %s:%d", host, bound)
    return store, bound
