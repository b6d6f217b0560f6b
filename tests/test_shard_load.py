"""Each server's load over time: the shard's counters (``ps/load.py``), ``Info``'s ``load``,
the launcher's ``shard_load`` events (``launcher/shard_load.py``) and their TensorBoard series.
One in-process server on a free loopback port; no process is started."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from distsgd.control.board import Series
from distsgd.launcher.shard_load import RATES, ShardLoadLog
from distsgd.ps import ParameterClient, PartitionPlan
from distsgd.ps.service import ParameterService
from distsgd.transport import ShardClient
from distsgd.transport.proto import distsgd_pb2 as pb


def test_pushes_and_pulls_are_counted_and_info_reports_them(
    ps_server: tuple[str, ParameterService],
) -> None:
    address, service = ps_server
    model = {"w": np.zeros((50, 20), np.float32), "b": np.zeros(20, np.float32)}
    nbytes = sum(v.nbytes for v in model.values())
    plan = PartitionPlan.from_arrays(model, 1)
    client = ParameterClient([address], plan, worker=0, timeout=10.0)
    try:
        client.register(model, scheme="hogwild", options={"lr": 0.1}, num_workers=1)
        for _ in range(3):
            client.pull()
            client.push({k: np.ones_like(v) for k, v in model.items()})
    finally:
        client.close()
    with ShardClient(address, timeout=10.0) as shard:
        info = shard.info()
    load = info.load
    assert (load.pushes, load.push_bytes) == (3, 3 * nbytes)
    assert load.pulls == 3 and load.pull_bytes == 3 * nbytes
    assert load.busy_seconds > 0
    assert service.shard is not None and service.shard.load.pushes == 3


def reading(pushes: int, pulls: int, busy: float) -> pb.InfoResponse:
    reply = pb.InfoResponse(registered=True)
    reply.load.CopyFrom(
        pb.ShardLoad(
            pushes=pushes,
            push_bytes=pushes * 2_000_000,
            pulls=pulls,
            pull_bytes=pulls * 2_000_000,
            busy_seconds=busy,
        )
    )
    return reply


def test_the_launcher_logs_rates_every_few_seconds() -> None:
    logged: list[dict[str, Any]] = []
    loads = ShardLoadLog(lambda **record: logged.append(record), every=5.0)
    loads.see(0, reading(0, 0, 0.0), now=100.0, step=0)  # the first reading: nothing yet
    loads.see(0, reading(20, 20, 0.5), now=103.0, step=10)  # too soon
    assert logged == []
    loads.see(0, reading(100, 90, 2.5), now=105.0, step=50)
    (event,) = logged
    assert event["event"] == "shard_load" and event["ps"] == 0 and event["step"] == 50
    assert event["pushes_per_s"] == 20.0 and event["pulls_per_s"] == 18.0
    assert event["push_mb_per_s"] == 40.0 and event["busy"] == 0.5
    assert set(RATES) <= set(event)
    loads.see(0, reading(3, 3, 0.1), now=111.0, step=60)  # a restarted server starts again
    loads.see(1, pb.InfoResponse(registered=True), now=111.0, step=60)  # no load: older
    assert len(logged) == 1
    loads.see(0, reading(53, 3, 1.1), now=116.0, step=70)
    assert logged[-1]["pushes_per_s"] == 10.0


def test_shard_load_events_are_series_not_text() -> None:
    series = Series()
    record = {"step": 50, "event": "shard_load", "ps": 1, "seconds": 5.0, "busy": 0.5,
              "push_mb_per_s": 40.0}  # fmt: skip
    points = series.points(record, 1.0)
    assert points.scalars["load/ps1/busy"] == 0.5
    assert points.scalars["load/ps1/push_mb_per_s"] == 40.0
    assert not points.texts and "load/ps1/seconds" not in points.scalars


@pytest.mark.parametrize("field", ["pushes", "push_bytes", "pulls", "pull_bytes", "busy_seconds"])
def test_the_proto_carries_each_counter(field: str) -> None:
    assert field in pb.ShardLoad.DESCRIPTOR.fields_by_name
