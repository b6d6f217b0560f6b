"""TensorFlow 2 reference for the benchmark suite: ParameterServerStrategy, one task a process.

Run with a Python that has TensorFlow (not distsgd's environment; see docs/performance.md):

    /tmp/tfenv/bin/python benchmarks/tf_pss.py --workers 2 --steps 500 --out tf.json

It starts one parameter server and ``--workers`` workers as separate processes on 127.0.0.1
(``tf.distribute.Server`` each, ``TF_CONFIG`` naming free ports), and is itself the chief: a
``ClusterCoordinator`` over ``tf.distribute.experimental.ParameterServerStrategy`` schedules
training steps on the workers, as in TensorFlow's parameter-server training tutorial. The model
is the suite's MLP (784-512-512-10 by default, float32, plain ``tf.Variable`` placed on the
parameter server, since Keras 3 does not support this strategy), batch 64 of random inputs with
a fixed seed, plain SGD (``assign_sub``) at ``--lr``. Every process runs one intra-op and one
inter-op thread.

What it measures: the steady state. It schedules ``--warmup`` steps per worker and joins (the
functions are traced, the datasets and connections built), then times ``--steps`` steps per
worker scheduled at once until ``join`` returns, and writes worker-steps per second (all
workers together) to ``--out`` as JSON. It stops every process it started, by PID, in any case.

``--placement FILE`` runs the tasks elsewhere than 127.0.0.1 (the across-hosts suite,
``across_hosts.py``): a JSON object ``{"chief": ADDRESS, "ps": [TASK], "worker": [TASK]}``, a
TASK being ``{"address": ADDRESS, "prefix": [ARGV...]}``: the task listens on its address (a
free port) and is started as ``prefix + [python, tf_pss.py, ...]`` (the ``nsenter`` prefix of
its emulated host); the chief runs here and listens on its address. Without it: as above.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

INPUTS, CLASSES = 784, 10


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _load_placement(path: Path, workers: int) -> dict[str, object]:
    """The ``--placement`` file, checked: one ps and ``workers`` workers, each with an address."""
    placement = json.loads(path.read_text())
    if len(placement.get("ps", [])) != 1 or len(placement.get("worker", [])) != workers:
        raise ValueError(f"{path}: needs 1 ps and {workers} workers; fix the placement file")
    if not isinstance(placement.get("chief"), str):
        raise ValueError(f"{path}: 'chief' must be the chief's address; fix the placement file")
    return placement


def _cluster(placement: dict | None, workers: int) -> tuple[dict, dict[str, list[list[str]]]]:  # type: ignore[type-arg]
    """TF_CONFIG's cluster (addresses with free ports) and the launch prefix of every task."""
    if placement is None:
        here = {"address": "127.0.0.1", "prefix": []}
        placement = {"chief": "127.0.0.1", "ps": [here], "worker": [here] * workers}
    cluster = {"chief": [f"{placement['chief']}:{_free_port()}"]}
    prefixes: dict[str, list[list[str]]] = {}
    for role in ("worker", "ps"):
        cluster[role] = [f"{task['address']}:{_free_port()}" for task in placement[role]]
        prefixes[role] = [list(task.get("prefix", [])) for task in placement[role]]
    return cluster, prefixes


def _limit_threads(tf) -> None:  # type: ignore[no-untyped-def]
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def _serve(role: str, index: int) -> None:
    """A ps or worker task: a TensorFlow server until the chief stops it."""
    import tensorflow as tf

    _limit_threads(tf)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(), job_name=role, task_index=index, protocol="grpc", start=True
    )
    server.join()


def _chief(args: argparse.Namespace) -> dict[str, float]:
    import tensorflow as tf

    _limit_threads(tf)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    widths = [INPUTS, *([args.hidden] * args.layers), CLASSES]
    with strategy.scope():
        init = tf.keras.initializers.GlorotUniform(seed=0)
        variables = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            variables.append(tf.Variable(init((a, b)), name=f"w{i}"))
            variables.append(tf.Variable(tf.zeros((b,)), name=f"b{i}"))
    params = sum(int(v.shape.num_elements()) for v in variables)

    def dataset_fn():  # type: ignore[no-untyped-def]
        x = tf.random.stateless_normal((args.samples, INPUTS), seed=(0, 1))
        teacher = tf.random.stateless_normal((INPUTS, CLASSES), seed=(0, 2))
        y = tf.argmax(tf.matmul(x, teacher), axis=1, output_type=tf.int32)
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(args.samples, seed=0)
        return data.batch(args.batch_size, drop_remainder=True).repeat().prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def train_step(it):  # type: ignore[no-untyped-def]
        def replica_fn(batch):  # type: ignore[no-untyped-def]
            x, y = batch
            with tf.GradientTape() as tape:
                h = x
                for i in range(0, len(variables), 2):
                    h = tf.matmul(h, variables[i]) + variables[i + 1]
                    if i + 2 < len(variables):
                        h = tf.nn.relu(h)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)
                )
            grads = tape.gradient(loss, variables)
            for v, g in zip(variables, grads, strict=True):
                v.assign_sub(args.lr * g)
            return loss

        losses = []
        for _ in range(args.steps_per_execution):
            losses.append(strategy.run(replica_fn, args=(next(it),)))
        return losses[-1]

    def run(steps: int) -> float:
        started = time.monotonic()
        for _ in range(steps // args.steps_per_execution):
            last = coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        seconds = time.monotonic() - started
        last.fetch()
        return seconds

    run(args.warmup * args.workers)
    steps = args.steps * args.workers
    seconds = run(steps)
    return {
        "worker_steps": steps,
        "seconds": seconds,
        "worker_steps_per_second": steps / seconds,
        "ms_per_step_per_worker": 1000 * seconds * args.workers / steps,
        "params": params,
        "tensorflow": tf.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per worker first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2, help="hidden layers")
    parser.add_argument("--samples", type=int, default=8192, help="random examples per worker")
    parser.add_argument(
        "--steps-per-execution", type=int, default=1, help="steps in one scheduled function"
    )
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    parser.add_argument(
        "--placement", type=Path, help="JSON file: each task's address and launch prefix"
    )
    parser.add_argument("--role", choices=["chief", "ps", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.role in ("ps", "worker"):
        _serve(args.role, args.index)
        return
    placement = _load_placement(args.placement, args.workers) if args.placement else None
    cluster, prefixes = _cluster(placement, args.workers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    children: list[subprocess.Popen[bytes]] = []
    try:
        for role in ("ps", "worker"):
            for index in range(len(cluster[role])):
                config = {"cluster": cluster, "task": {"type": role, "index": index}}
                children.append(
                    subprocess.Popen(
                        [
                            *prefixes[role][index],
                            *[sys.executable, __file__, "--role", role, "--index", str(index)],
                        ],
                        env={**env, "TF_CONFIG": json.dumps(config)},
                        stdin=subprocess.DEVNULL,
                    )
                )
        os.environ.update(env)
        os.environ["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "chief", "index": 0}}
        )
        result = _chief(args)
        result.update(workers=args.workers, batch_size=args.batch_size, hidden=args.hidden)
        result["steps_per_execution"] = args.steps_per_execution
        text = json.dumps(result, indent=2)
        print(text, flush=True)
        if args.out:
            args.out.write_text(text + "\n")
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGKILL)
        for child in children:
            child.wait()
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's coordinator threads can hold interpreter exit for seconds


if __name__ == "__main__":
    main()
