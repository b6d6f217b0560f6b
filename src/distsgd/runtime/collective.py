"""Collectives over torch.distributed (gloo on CPU, NCCL on GPU) for all-reduce style schemes."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


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
    ) -> None:
        host, _, port = rendezvous.rpartition(":")
        self.rank = rank
        self.world_size = world_size
        self.bytes_sent = 0
        self.left = False
        store = dist.TCPStore(
            host.strip("[]"),
            int(port),
            world_size=world_size if host_store else None,
            is_master=host_store,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        log.info(
            "joined %s process group as rank %d of %d via %s", backend, rank, world_size, rendezvous
        )

    @torch.no_grad()
    def allreduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its mean over all workers."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world_size
        self.bytes_sent += flat.numel() * flat.element_size()
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    @torch.no_grad()
    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Copy rank ``src``'s tensors to every worker, in place."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def barrier(self) -> None:
        dist.barrier()

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
