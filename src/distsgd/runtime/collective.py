"""Collectives over torch.distributed (gloo on CPU, NCCL on GPU) for all-reduce style schemes.

Every socket this module opens listens where the cluster spec says, never on all interfaces:
:func:`distsgd.control.rendezvous.host_store` binds the rendezvous store to its host, and the
gloo device of each worker listens on that worker's own host (loopback for ``distsgd run``).
The store's keys live under ``distsgd/<run id>/``. Neither the store nor gloo can carry TLS
or the run secret, so a rendezvous or data plane beyond loopback is logged as a warning
(:func:`exposure_warning`) unless :data:`TRUSTED_NETWORK_ENV` says the network is trusted
(docs/security.md).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distsgd.control.rendezvous import WILDCARDS
from distsgd.control.rendezvous import host_store as open_store
from distsgd.runtime.encoded_mean import EncodedMean
from distsgd.transport.security import TRUSTED_NETWORK_ENV, is_loopback

log = logging.getLogger(__name__)

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""torch's own variable: gloo listens on these interfaces (comma-separated) when it is set."""

GLOO_BACKEND = "distsgd_gloo"
"""gloo, with the device (listening address) distsgd chose; registered with torch once."""


def _loopback_interface(name: str) -> bool:
    return name == "lo" or (name.startswith("lo") and name[2:].isdigit())


def data_plane(
    backend: str, address: str, environ: Mapping[str, str] | None = None
) -> tuple[str, bool]:
    """Where this worker's collective data plane listens, in words, and whether that is
    loopback only.

    gloo listens on the interfaces ``GLOO_SOCKET_IFNAME`` names when it is set (torch reads
    it itself), otherwise on the host of ``address``, this worker's own ``host:port`` in the
    cluster spec; a wildcard or empty host leaves the choice to gloo: the address the
    machine's hostname resolves to. NCCL picks its interfaces itself (``NCCL_SOCKET_IFNAME``).
    """
    env = os.environ if environ is None else environ
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else GLOO_IFNAME_ENV
    interfaces = [i.strip() for i in env.get(variable, "").split(",") if i.strip()]
    if interfaces:
        where = f"interface {','.join(interfaces)} ({variable})"
        return where, all(_loopback_interface(i) for i in interfaces)
    if backend == "nccl":
        return f"the interfaces NCCL picks ({variable} unset)", False
    host = address.rpartition(":")[0].strip().strip("[]")
    if host in WILDCARDS:
        return f"the address of hostname {socket.gethostname()!r}", False
    return host, is_loopback(host)


def exposure_warning(
    rendezvous: str, data_plane: tuple[str, bool], environ: Mapping[str, str] | None = None
) -> str | None:
    """A one-line warning when the rendezvous store (``host:port``) or the data plane
    (:func:`data_plane`'s answer) is reachable beyond loopback, or None: when both are on
    loopback, or when :data:`TRUSTED_NETWORK_ENV` is 1."""
    env = os.environ if environ is None else environ
    where, loopback = data_plane
    exposed = [] if is_loopback(rendezvous.rpartition(":")[0]) else [f"rendezvous {rendezvous}"]
    if not loopback:
        exposed.append(f"data plane on {where}")
    if not exposed or env.get(TRUSTED_NETWORK_ENV, "") == "1":
        return None
    return (
        f"collective {' and '.join(exposed)} beyond loopback: the torch.distributed store and "
        "the gloo (or NCCL) data plane carry neither TLS nor the run secret, so anyone who can "
        "reach these ports can read and change the run's keys, gradients and parameters; use it "
        f"on a trusted network only ({TRUSTED_NETWORK_ENV}=1 says it is one), or bind loopback"
    )


def _create_gloo(backend_opts: Any, options: Any) -> dist.ProcessGroupGloo:
    """Backend factory of :data:`GLOO_BACKEND`: gloo with the devices in ``options``."""
    options._timeout = backend_opts.timeout
    gloo = dist.ProcessGroupGloo(  # type: ignore[call-arg]
        backend_opts.store, backend_opts.group_rank, backend_opts.group_size, options
    )
    gloo.options.global_ranks_in_group = backend_opts.global_ranks_in_group
    gloo.options.group_name = backend_opts.group_id
    return gloo


def _gloo_options(host: str, address: str) -> Any:
    """Options of :data:`GLOO_BACKEND` whose device listens on ``host`` (registered once)."""
    if not hasattr(dist.Backend, GLOO_BACKEND.upper()):
        dist.Backend.register_backend(GLOO_BACKEND, _create_gloo, extended_api=True, devices="cpu")
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    try:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    except RuntimeError as exc:
        raise ValueError(
            f"this worker's address {address}: gloo cannot listen on {host} "
            f"({str(exc).splitlines()[0]}); give each worker an address of its own machine"
        ) from exc
    return options


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors``, in place."""
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(piece.view_as(t))


class PendingMean:
    """A mean over workers that :meth:`Collective.start_mean` started; :meth:`wait` ends it."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        flat: torch.Tensor,
        work: Any,
        world_size: int,
        *,
        codec: EncodedMean | None = None,
        frames: list[torch.Tensor] | None = None,
    ) -> None:
        self.tensors, self.flat, self.work, self.world_size = tensors, flat, work, world_size
        self.codec, self.frames = codec, frames

    @torch.no_grad()
    def wait(self) -> None:
        """Wait for the collective (its timeout is the group's) and write the means in place."""
        if self.work is not None:
            self.work.wait()
        flat = self.flat
        if self.codec is None:
            flat /= self.world_size
        else:
            assert self.frames is not None
            mean = self.codec.mean([f.cpu().numpy() for f in self.frames], flat.numel())
            flat = torch.from_numpy(mean).to(flat.device, flat.dtype)
        _unflatten(flat, self.tensors)


class Collective:
    """A process group of all workers; tensors are flattened into one bucket per call."""

    def __init__(
        self,
        *,
        rendezvous: str,
        rank: int,
        world_size: int,
        host_store: bool,
        timeout: float,
        device: torch.device,
        run_id: str = "",
        address: str = "",
    ) -> None:
        """Join the group through the store at ``rendezvous`` (hosted here if ``host_store``);
        ``address`` is this worker's own ``host:port`` in the cluster spec: gloo listens on its
        host (``""``: gloo's own choice)."""
        host, _, port = rendezvous.rpartition(":")
        self.rank = rank
        self.world_size = world_size
        self.bytes_sent = 0
        self.left = False
        wait = timedelta(seconds=timeout)
        store: dist.Store
        if host_store:
            store, _ = open_store(host, wait, port=int(port), world_size=world_size)
        else:
            store = dist.TCPStore(
                host.strip("[]"), int(port), None, False, wait, wait_for_workers=False
            )
        store = dist.PrefixStore(f"distsgd/{run_id}" if run_id else "distsgd", store)  # + "/"
        backend = "nccl" if device.type == "cuda" else "gloo"
        where, loopback = data_plane(backend, address)
        pg_options = None
        own_host = address.rpartition(":")[0].strip().strip("[]")
        if backend == "gloo" and where == own_host:  # else torch's choice: the env, the hostname
            backend, pg_options = GLOO_BACKEND, _gloo_options(own_host, address)
        warning = exposure_warning(rendezvous, (where, loopback))
        if warning is not None:
            log.warning("%s", warning)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=wait,
            pg_options=pg_options,
        )
        log.info(
            "joined %s process group as rank %d of %d via %s (data plane on %s)",
            backend,
            rank,
            world_size,
            rendezvous,
            where,
        )

    @torch.no_grad()
    def allreduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its mean over all workers."""
        self.start_mean(tensors).wait()

    @torch.no_grad()
    def start_mean(
        self, tensors: list[torch.Tensor], *, codec: EncodedMean | None = None, key: str = ""
    ) -> PendingMean:
        """Start averaging ``tensors`` over all workers in the background (gloo's threads);
        :meth:`PendingMean.wait` writes the means into them. Leave the tensors alone until then.

        ``codec``: all-gather this worker's encoded frame (under ``key``, for its error
        feedback) instead of all-reducing float32; every rank must pass the same codec kind
        and start the same means in the same order, as for any collective."""
        if not tensors:
            return PendingMean([], torch.zeros(0), None, self.world_size)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if codec is None:
            self.bytes_sent += flat.numel() * flat.element_size()
            work = dist.all_reduce(flat, async_op=True)
            return PendingMean(tensors, flat, work, self.world_size)
        values = flat.detach().to("cpu", torch.float32).numpy()
        frame = torch.from_numpy(codec.encode(key, values)).to(flat.device)
        self.bytes_sent += frame.numel()
        frames = [torch.empty_like(frame) for _ in range(self.world_size)]
        work = dist.all_gather(frames, frame, async_op=True)
        return PendingMean(tensors, flat, work, self.world_size, codec=codec, frames=frames)

    @torch.no_grad()
    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Copy rank ``src``'s tensors to every worker, in place."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src)
        _unflatten(flat, tensors)

    def leave(self) -> None:
        """The normal end: wait until every rank is done, then leave the group as it is.

        Destroying a gloo group right after a barrier can make a peer that is still tearing
        down abort ("terminate called without an active exception"; pytorch/gloo issue 155);
        it happened in one CI run in twenty collective runs. The process exits soon after
        without running C++ destructors (``launcher.bootstrap.exit_now``), which closes the
        sockets instead.
        """
        dist.barrier()
        self.left = True

    def close(self) -> None:
        """Destroy the group, unless :meth:`leave` ended it normally."""
        if dist.is_initialized() and not self.left:
            dist.destroy_process_group()
