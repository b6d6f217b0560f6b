"""The inputs the planner assumes where it measured nothing, the wire's byte factors, and the
recommendation: which number of servers and which wire setting to run.

The assumed paths are this project's own measurements on its 2-core CI machine (AMD EPYC):
docs/performance.md, figure 5 (pull and push through one server, at the 2.7 MB MLP's size) and
figure 3 (all-reduce over gloo on loopback). ``distsgd plan`` replaces them with figures it
measures on the machine it runs on unless told not to (``--assume``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from distsgd.plan.cost import Cluster, Part, Path, Prediction, Setting, Workload, predict
from distsgd.ps import wire
from distsgd.ps.compression import encoding_for, value_bytes
from distsgd.ps.pull_encoding import pull_encoding_for

_FIG5 = "docs/performance.md figure 5 (2-core AMD EPYC, 2.7 MB model)"
_LATENCY = Part(value=1e-4, source="assumed: 0.1 ms a call on loopback (docs/performance.md)")

ASSUMED_PATHS: dict[str, Path] = {
    "shared memory": Path(
        name="shared memory",
        latency=_LATENCY,
        pull=Part(value=2.9e9, source=f"assumed: 0.92 ms a pull, {_FIG5}"),
        push=Part(value=1.8e9, source=f"assumed: 1.50 ms a push, {_FIG5}"),
        encoded_pulls=False,
    ),
    "tensor socket": Path(
        name="tensor socket",
        latency=_LATENCY,
        pull=Part(value=1.5e9, source=f"assumed: tensor socket pulls, {_FIG5}"),
        push=Part(value=1.1e9, source=f"assumed: tensor socket pushes, {_FIG5}"),
    ),
    "gloo": Path(
        name="gloo",
        latency=_LATENCY,
        pull=Part(value=0.42e9, source="assumed: DDP over gloo on loopback, docs/performance.md"),
        push=Part(value=0.42e9, source="assumed: DDP over gloo on loopback, docs/performance.md"),
    ),
}
"""Each data path's figures where nothing was measured."""


LINK_PAYLOAD = Part(
    value=0.86,
    source="assumed: payload is 86% of a link's rate (TCP/IP headers and acknowledgements; the "
    "busiest second of a shaped emulated link carried 85-87%, docs/performance.md)",
)
"""The share of a link's nominal rate that carries tensors."""


def link_bytes_per_s(rate: str) -> float:
    """A ``--link`` rate (``1gbit``) as the payload bytes per second it carries each way."""
    from distsgd.cluster.rates import parse_rate

    return parse_rate(rate) / 8 * LINK_PAYLOAD.value


def push_factor(wire_dtype: str = "float32", topk: float = 0.0) -> float:
    """Bytes a push sends per float32 byte: the value's size over 4, and with top-k of a
    fraction ``topk`` the kept share, each value beside a 4-byte index."""
    size = value_bytes(encoding_for(wire_dtype), "float32") / 4
    if topk:
        return min(2.0, topk * (size + 1.0))
    return size


def pull_factor(pull_dtype: str = "float32") -> float:
    """Bytes a pull brings per float32 byte."""
    return value_bytes(pull_encoding_for(pull_dtype), "float32") / 4


def push_encode(wire_dtype: str = "float32", topk: float = 0.0) -> float:
    """CPU seconds per float32 byte to encode and decode a push (the wire vocabulary's
    assumed or measured costs, :mod:`distsgd.ps.wire`)."""
    encoding_for(wire_dtype)  # the flag's one check
    return wire.TOPK_COST if topk else wire.named(wire_dtype).cost


def pull_encode(pull_dtype: str = "float32") -> float:
    """CPU seconds per float32 byte to encode and decode a pull."""
    pull_encoding_for(pull_dtype)
    return wire.named(pull_dtype).cost


WIRES: tuple[tuple[str, str], ...] = tuple(
    (push.name, pull.name)
    for push, pull in (
        (wire.FLOAT32, wire.FLOAT32),
        (wire.BF16, wire.FLOAT32),
        (wire.BF16, wire.BF16),
        (wire.INT8, wire.BF16),
    )
)
"""(--wire-dtype, --pull-dtype) the recommendation tries, the lightest compression first."""

MARGIN = 0.1
"""A costlier choice (more servers, more compression) must predict this much more to win."""


def wire_flags(wire: str, pull: str) -> str:
    """The flags of a wire setting (nothing for the default)."""
    flags = [f"--wire-dtype {wire}"] if wire != "float32" else []
    flags += [f"--pull-dtype {pull}"] if pull != "float32" else []
    return " ".join(flags)


def recommend(
    setting: Setting,
    workload: Workload,
    cluster: Cluster,
    path_for: Callable[[Cluster], Path],
    max_ps: int | None = None,
) -> tuple[Prediction, str]:
    """The best choice of servers and wire for a parameter-server ``setting``: each number of
    servers up to ``max_ps`` (default: the workers') and, where tasks talk over links, each of
    :data:`WIRES`, cheapest first (on one host, float32 only);
    a costlier choice replaces the current one only if it predicts ``MARGIN`` more. Returns its
    prediction and its flags (``--ps M`` and the wire's)."""
    assert setting.exchange.kind != "collective", "collective schemes have no servers to choose"
    limit = max_ps if max_ps is not None else cluster.workers
    # On one host a transfer is a copy: its time is mostly a fixed cost per call, which the
    # probe cannot tell from its bytes, and an encoding only adds CPU (docs/compression.md).
    wires = WIRES if cluster.link is not None else WIRES[:1]
    best: tuple[Prediction, str] | None = None
    for servers in (2**i for i in range(max(1, limit).bit_length())):  # 1, 2, 4 ... up to it
        for push, pull in wires:
            candidate = replace(
                setting,
                push_factor=push_factor(push),
                pull_factor=pull_factor(pull),
                push_encode=push_encode(push),
                pull_encode=pull_encode(pull),
            )
            shaped = replace(cluster, ps=servers)
            got = predict(candidate, workload, shaped, path_for(shaped))
            flags = " ".join(f for f in (f"--ps {servers}", wire_flags(push, pull)) if f)
            if best is None or got.rate > best[0].rate * (1 + MARGIN):
                best = (got, flags)
    assert best is not None
    return best
