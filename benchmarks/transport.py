"""Pull and push throughput through one ``distsgd server`` process, against model size.

    python benchmarks/transport.py --sizes 1,4,16,64,256 --out transport.json

For each size it starts a fresh ``distsgd server`` on 127.0.0.1 port 0 (it writes the address
it bound to ``--address-file``), with a run secret as ``distsgd run`` gives one, registers a
model of ``--pieces`` equal float32 pieces as the chief does (``PartitionPlan.from_arrays``,
``ParameterClient.register``, scheme hogwild, lr 0.01), then times ``ParameterClient.pull()``
and ``push()`` of the whole model, alternating the data paths (A B C A B C ...; one client
each, workers 0, 1, 2). A pull writes into arrays of the model's shapes (``pull(into=...)``),
as a worker's pull writes into its model's parameters. A push is a gradient the server applies
(Hogwild's SGD), so its time includes that update. It reports the median seconds of each and
GB/s (10**9 bytes per second) as JSON.

The data paths (``PATHS``): gRPC (the stream: every other path off), the tensor socket
(``ParameterClient(..., tensor_socket=True)``: tensor bytes on a plain TCP connection beside
gRPC) and shared memory (``shared_memory=True``), twice: a push of the client's own arrays
(copied into the segment), and a push of a gradient already in the segment's push area
(``ParameterClient.push_buffers()``, written there untimed, as Hogwild's backward writes it).
A build whose ParameterClient lacks a path's keyword reports that path as not available in this
build. The server it started is stopped by PID in any case.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from distsgd.ps.client import ParameterClient
from distsgd.ps.partition import PartitionPlan
from distsgd.transport.security import SECRET_FILE_ENV, write_secret_file

MB = 1_000_000


PATHS = {
    "grpc": ("gRPC", None),
    "socket": ("tensor socket", "tensor_socket"),
    "shm": ("shared memory", "shared_memory"),
    "inplace": ("shared memory, gradient in place", "shared_memory"),
}
"""name: (label, the ParameterClient keyword that turns the path on; None: the stream)."""
SWITCHES = ("shared_memory", "tensor_socket")


def available_paths() -> dict[str, dict[str, bool]]:
    """The paths this build's ParameterClient offers, each with the keywords that select it."""
    keywords = inspect.signature(ParameterClient).parameters
    switches = [k for k in SWITCHES if k in keywords]
    out = {}
    for name, (_, keyword) in PATHS.items():
        if keyword is None or keyword in switches:
            out[name] = {k: k == keyword for k in switches}
    return out


def _start_server(
    folder: Path, secret_file: Path, wal: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    address_file = folder / "ps0.address"
    env = {
        **os.environ,
        SECRET_FILE_ENV: str(secret_file),
        "DISTSGD_PARENT_PID": str(os.getpid()),
        "DISTSGD_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    args = ["server", "--task", "0", "--ps-hosts", "127.0.0.1:0", "--worker-hosts", "127.0.0.1:0"]
    args += ["--wal-dir", str(folder / "wal")] if wal else ["--wal", "off"]
    log = (folder / "ps0.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "distsgd", *args, "--address-file", str(address_file)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"distsgd server did not start: {(folder / 'ps0.log').read_text()}")
        time.sleep(0.02)
    return proc, address_file.read_text().strip()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(
    address: str, plan: PartitionPlan, worker: int, secret: str, switches: dict[str, bool]
) -> Any:
    return ParameterClient([address], plan, worker=worker, secret=secret, **switches)


def measure_size(
    megabytes: float,
    pieces: int,
    repeats: int,
    folder: Path,
    secret_file: Path,
    secret: str,
    wal: bool = False,
) -> dict[str, Any]:
    """Median pull and push seconds of one model size, for each data path."""
    per_piece = max(1, int(megabytes * MB / 4 / pieces))
    rng = np.random.default_rng(0)
    arrays = {f"p{i}": rng.standard_normal(per_piece, dtype=np.float32) for i in range(pieces)}
    grads = {k: np.full_like(v, 1e-6) for k, v in arrays.items()}
    nbytes = sum(a.nbytes for a in arrays.values())
    plan = PartitionPlan.from_arrays(arrays, 1)
    paths = available_paths()
    proc, address = _start_server(folder, secret_file, wal)
    clients: dict[str, Any] = {}
    try:
        chief = _client(address, plan, 0, secret, paths["grpc"])
        chief.register(
            arrays,
            scheme="hogwild",
            options={"lr": 0.01, "momentum": 0.0},
            num_workers=len(paths),
        )
        chief.close()
        for worker, (name, switches) in enumerate(paths.items()):
            clients[name] = _client(address, plan, worker, secret, switches)
            clients[name].wait_registered(30)
        times: dict[str, dict[str, list[float]]] = {n: {"pull": [], "push": []} for n in paths}
        into = {k: np.empty_like(v) for k, v in arrays.items()}  # the worker's parameters
        for round_ in range(repeats + 1):  # round 0 warms the channels up, untimed
            for name, client in clients.items():  # A B A B
                payload = grads
                if name == "inplace":  # the gradient where backward would have written it
                    buffers = client.push_buffers()
                    if buffers is None:
                        raise RuntimeError("no push buffers in shared memory")
                    for key, array in grads.items():
                        np.copyto(buffers[key], array)
                    payload = buffers
                started = time.perf_counter()
                client.pull(into=into)
                pulled = time.perf_counter()
                client.push(payload)
                pushed = time.perf_counter()
                if round_:
                    times[name]["pull"].append(pulled - started)
                    times[name]["push"].append(pushed - pulled)
        # which path each client really used (a failed attach falls back to the stream)
        used = {
            name: {
                k: getattr(client, f"{k}_shards")
                for k in SWITCHES
                if hasattr(client, f"{k}_shards")
            }
            for name, client in clients.items()
        }
    finally:
        for client in clients.values():
            with contextlib.suppress(Exception):
                client.close()
        _stop(proc)
    out: dict[str, Any] = {"megabytes": nbytes / MB, "bytes": nbytes, "pieces": pieces, "wal": wal}
    out["shards_on_path"] = used
    for name, kinds in times.items():
        for kind, seconds in kinds.items():
            median = statistics.median(seconds)
            out[f"{name}_{kind}_s"] = median
            out[f"{name}_{kind}_gbps"] = nbytes / median / 1e9
            out[f"{name}_{kind}_all_s"] = seconds
    return out


def repeats_for(megabytes: float, quick: bool) -> int:
    if quick:
        return 3
    return max(3, min(20, int(320 / megabytes)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64,256", help="model sizes in MB (10**6 B)")
    parser.add_argument("--pieces", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="3 timed rounds per size")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--wal",
        choices=("on", "off"),
        default="off",
        help="the server's write-ahead log (a run's default is on; off: the transport alone)",
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="distsgd-transport-") as tmp:
        secret_file = Path(tmp) / "secret"
        secret = write_secret_file(secret_file)
        for text in args.sizes.split(","):
            size = float(text)
            folder = Path(tmp) / f"{text}mb"
            folder.mkdir()
            row = measure_size(
                size,
                args.pieces,
                repeats_for(size, args.quick),
                folder,
                secret_file,
                secret,
                args.wal == "on",
            )
            rows.append(row)
            shown = ", ".join(f"{k[:-5]} {row[k]:.2f} GB/s" for k in row if k.endswith("_gbps"))
            print(f"{row['megabytes']:.0f} MB: {shown}", flush=True)
    paths = available_paths()
    result = {
        "paths": {
            name: {"label": label, "available": name in paths} for name, (label, _) in PATHS.items()
        },
        "sizes": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
