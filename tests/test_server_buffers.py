"""A server's memory for its workers' pushes and pulls is bounded: it reaches their shared
segments through descriptors (nothing of a worker's areas mapped into it), and its pushes land
in one :class:`~distsgd.ps.segments.ScratchPool` per shard, of a bounded size."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from distsgd.ps.segments import ScratchPool
from distsgd.transport import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def _maps_of_this_process(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def test_an_unmapped_segment_is_read_and_written_through_its_descriptor() -> None:
    server = shm.Segment.create(shm.run_prefix("buffers-test"), 4096, mapped=False)
    try:
        assert not _maps_of_this_process(server.name)  # the server's side maps nothing
        worker = shm.Segment.open(server.name, 4096)
        try:
            assert worker.nonce == server.nonce and len(server.nonce) == shm.NONCE_BYTES
            values = np.arange(100, dtype=np.float32)
            server.write_at(128, values)  # a pull: the server writes, the worker reads
            assert np.array_equal(worker.array(128, np.dtype(np.float32), (100,)), values)
            worker.array(1024, np.dtype(np.float32), (100,))[:] = -values  # a push
            got = np.empty(100, np.float32)
            server.read_into(1024, got)
            assert np.array_equal(got, -values)
            for bad in (lambda: server.read_into(4000, got), lambda: server.write_at(-64, got)):
                with pytest.raises(shm.SegmentError, match="not inside"):
                    bad()
            with pytest.raises(ValueError, match="contiguous"):
                server.write_at(128, np.zeros((10, 10), np.float32)[:, 0])
        finally:
            worker.close()
    finally:
        server.close()


def test_the_pool_reuses_its_buffers_within_its_budget() -> None:
    pool = ScratchPool(budget=1000)
    with pool.take(300) as a, pool.take(300) as b:
        assert a.size == b.size == 300 and not np.shares_memory(a, b)
    assert pool.nbytes == 600
    with pool.take(200) as c:  # the smallest free buffer that fits, no new one
        assert c.size == 200
    assert pool.nbytes == 600
    with pool.take(900) as d:  # too small to reuse: the free ones make room for it
        assert d.size == 900
    assert pool.nbytes == 900


def test_a_push_larger_than_the_budget_gets_one_buffer_and_the_next_waits_for_it() -> None:
    pool = ScratchPool(budget=100)
    order: list[str] = []
    with pool.take(500) as first:
        assert first.size == 500 and pool.nbytes == 500

        def second() -> None:
            with pool.take(500):
                order.append("second")

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        order.append("first done")
    thread.join(5)
    assert order == ["first done", "second"]
    assert pool.nbytes == 500  # the same buffer served both
