"""The benchmark suite's PyTorch references: plain training in one process, or DDP over gloo.

    python benchmarks/reference.py plain --steps 500 --out plain.json [--hidden 512]
    python benchmarks/reference.py ddp --rank R --world 2 --store-file F --steps 500 --out r.json

Same MLP, data, batch, learning rate and one thread per process as the distsgd runs
(``workload.py``); only the training loop is timed, as distsgd's ``finished_steps`` times its
loop. ``--ready-dir`` with ``--peers N`` makes N independent processes start their loops
together (each waits for the others' ready files), so their rates overlap as a cluster's do.
DDP: rank 0 hosts the torch.distributed TCPStore on 127.0.0.1 port 0 and writes the port it got
to ``--store-file``; the others read it there. The gloo process group then binds its own ports.
``--address`` puts the store elsewhere (rank 0's address on emulated hosts: ``across_hosts.py``
starts each rank inside its host, with ``GLOO_SOCKET_IFNAME`` naming the host's link).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload


def _wait_for_peers(ready_dir: Path, peers: int, name: str, timeout: float = 120.0) -> None:
    ready_dir.mkdir(parents=True, exist_ok=True)
    (ready_dir / name).write_text(str(os.getpid()))
    deadline = time.monotonic() + timeout
    while len(list(ready_dir.iterdir())) < peers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(ready_dir.iterdir()))} of {peers} peers ready")
        time.sleep(0.005)


def _store(  # type: ignore[no-untyped-def]
    rank: int, world: int, store_file: Path, address: str = "127.0.0.1", timeout: float = 120.0
):
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore(
            address,
            0,
            world,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        tmp = store_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.replace(store_file)
        return store
    deadline = time.monotonic() + timeout
    while not store_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no store port in {store_file}")
        time.sleep(0.01)
    port = int(store_file.read_text())
    return dist.TCPStore(address, port, world, is_master=False, timeout=timedelta(seconds=timeout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["plain", "ddp"])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--hidden", type=int, default=workload.HIDDEN)
    parser.add_argument("--samples", type=int, default=workload.SAMPLES)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--store-file", type=Path)
    parser.add_argument("--address", default="127.0.0.1", help="the ddp store's address (rank 0's)")
    parser.add_argument("--ready-dir", type=Path)
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    workload.limit_threads()
    model = workload.build_model(args.hidden)
    x, y = workload.make_data(args.samples)
    if args.mode == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if args.store_file is None:
            parser.error("ddp needs --store-file")
        store = _store(args.rank, args.world, args.store_file, args.address)
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
        model = DistributedDataParallel(model)  # broadcasts rank 0's parameters: start-up
        # this rank's shard, as distsgd gives each worker a disjoint one
        x, y = x[args.rank :: args.world], y[args.rank :: args.world]
    elif args.ready_dir is not None:
        x, y = x[args.rank :: args.peers], y[args.rank :: args.peers]
        _wait_for_peers(args.ready_dir, args.peers, f"rank{args.rank}")
    result = workload.train_loop(model, x, y, args.steps, seed=args.rank)
    result.update(mode=args.mode, rank=args.rank, hidden=args.hidden)
    args.out.write_text(json.dumps(result) + "\n")
    if args.mode == "ddp":
        import torch.distributed as dist

        # Both ranks have measured; leave together, without destroy_process_group: a rank
        # tearing gloo down while its peer still leaves the barrier can abort it (SIGABRT).
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
