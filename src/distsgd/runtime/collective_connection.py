"""A worker's connection to the other workers of a collective scheme:
:class:`CollectiveConnection`, a :class:`~distsgd.runtime.collective.Collective` process group
joined through the run's rendezvous store."""

from __future__ import annotations

import torch

from distsgd.control.task import TaskEnv
from distsgd.runtime.collective import Collective
from distsgd.runtime.connection import Connection


class CollectiveConnection(Connection):
    """A worker of a collective scheme (allreduce, localsgd, diloco) among two or more: the
    process group its scheme all-reduces over. Every worker counts the same steps, so the
    cluster's step count is its own."""

    def __init__(self, collective: Collective) -> None:
        self.collective: Collective = collective

    @classmethod
    def open(cls, env: TaskEnv, device: torch.device) -> CollectiveConnection:
        """Join the process group of ``env``'s workers through the rendezvous store (the
        chief's own address, where it hosts the store, unless the run names one)."""
        spec, rank = env.spec, env.task_index
        collective = Collective(
            rendezvous=env.rendezvous or spec.worker[0],
            rank=rank,
            world_size=env.num_workers,
            host_store=rank == 0 and not env.rendezvous,
            timeout=env.startup_timeout,
            device=device,
            run_id=env.run_id,
            address=spec.worker[rank],
        )
        return cls(collective)

    def part(self) -> None:
        self.collective.leave()  # every rank done; see Collective.leave for why not destroyed

    def close(self) -> None:
        self.collective.close()
