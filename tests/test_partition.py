"""Tests for distsgd.ps.partition: placement of parameter pieces on parameter-server shards."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distsgd.ps.partition import ParamInfo, PartitionPlan

DTYPES = ["float32", "float64", "float16", "int64", "int32", "uint8", "bool"]

shapes = st.lists(st.integers(min_value=0, max_value=12), min_size=0, max_size=3).map(tuple)
param_lists = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=8).map(
    lambda items: [ParamInfo(name=f"p{i}", shape=s, dtype=d) for i, (s, d) in enumerate(items)]
)


def _arrays_for(params: list[ParamInfo], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for p in params:
        if p.dtype == "bool":
            out[p.name] = rng.integers(0, 2, size=p.shape).astype(bool)
        elif np.issubdtype(np.dtype(p.dtype), np.integer):
            out[p.name] = rng.integers(0, 100, size=p.shape).astype(p.dtype)
        else:
            out[p.name] = rng.standard_normal(p.shape).astype(p.dtype)
    return out


def _check_coverage(plan: PartitionPlan) -> None:
    """Every element of every parameter lies in exactly one piece; keys are unique."""
    keys = [piece.key for piece in plan.pieces]
    assert len(keys) == len(set(keys)), keys
    for p in plan.params:
        counts = np.zeros(p.numel, dtype=np.int64)
        mine = [piece for piece in plan.pieces if piece.param.name == p.name]
        assert mine, f"{p.name} has no piece"
        for piece in mine:
            assert 0 <= piece.start <= piece.stop <= p.numel
            assert 0 <= piece.shard < plan.num_shards
            counts[piece.start : piece.stop] += 1
        assert np.all(counts == 1), f"{p.name}: coverage {counts.tolist()}"
    for piece in plan.pieces:
        assert math.prod(piece.shape) == piece.stop - piece.start


def _plan_signature(plan: PartitionPlan) -> list[tuple[str, int, int, int]]:
    return [(pc.param.name, pc.start, pc.stop, pc.shard) for pc in plan.pieces]


@settings(max_examples=80, deadline=None)
@given(params=param_lists, num_shards=st.integers(min_value=1, max_value=6))
def test_every_element_covered_exactly_once(params: list[ParamInfo], num_shards: int) -> None:
    plan = PartitionPlan(params, num_shards)
    _check_coverage(plan)
    assert sum(plan.shard_bytes) == sum(p.nbytes for p in params)
    for s in range(num_shards):
        assert plan.shard_bytes[s] == sum(pc.nbytes for pc in plan.shard_pieces(s))


@settings(max_examples=60, deadline=None)
@given(
    params=param_lists,
    num_shards=st.integers(min_value=1, max_value=6),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_split_join_round_trip_is_exact(
    params: list[ParamInfo], num_shards: int, seed: int
) -> None:
    plan = PartitionPlan(params, num_shards)
    arrays = _arrays_for(params, seed)
    parts = plan.split(arrays)
    assert len(parts) == num_shards
    for s, part in enumerate(parts):
        assert set(part) == {pc.key for pc in plan.shard_pieces(s)}
        for pc in plan.shard_pieces(s):
            assert part[pc.key].shape == pc.shape
            assert part[pc.key].dtype == np.dtype(pc.param.dtype)
    joined = plan.join(parts)
    assert list(joined) == [p.name for p in params]
    for p in params:
        assert joined[p.name].shape == p.shape
        assert joined[p.name].dtype == arrays[p.name].dtype
        np.testing.assert_array_equal(joined[p.name], arrays[p.name])


def test_split_join_round_trip_through_copies() -> None:
    """Joining copies (as they come back over the wire) is exact, including non-contiguous input."""
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    arrays = {"w": base.T, "b": np.arange(7, dtype=np.float64)}  # w is not C-contiguous
    plan = PartitionPlan.from_arrays(arrays, 3)
    parts = [{k: np.array(v, copy=True) for k, v in part.items()} for part in plan.split(arrays)]
    joined = plan.join(parts)
    np.testing.assert_array_equal(joined["w"], base.T)
    np.testing.assert_array_equal(joined["b"], arrays["b"])


def test_split_rejects_wrong_shape() -> None:
    plan = PartitionPlan([ParamInfo(name="w", shape=(2, 3), dtype="float32")], 2)
    with pytest.raises(ValueError, match="w"):
        plan.split({"w": np.zeros((3, 2), dtype=np.float32)})


@settings(max_examples=80, deadline=None)
@given(params=param_lists, num_shards=st.integers(min_value=2, max_value=6))
def test_balanced_by_bytes(params: list[ParamInfo], num_shards: int) -> None:
    plan = PartitionPlan(params, num_shards)
    total = sum(p.nbytes for p in params)
    largest_piece = max(pc.nbytes for pc in plan.pieces)
    # Greedy LPT: the most loaded shard got its last piece when it was the least loaded one,
    # so its load is at most the fair share plus one piece.
    assert max(plan.shard_bytes) <= total / num_shards + largest_piece
    # And the split keeps pieces near the fair share, so no shard holds much more than twice it
    # (plus one element of rounding per piece).
    fair = math.ceil(total / num_shards) if total else 0
    itemsize = max(np.dtype(p.dtype).itemsize for p in params)
    assert largest_piece <= fair + itemsize


def test_balanced_many_equal_tensors() -> None:
    params = [ParamInfo(name=f"l{i}", shape=(100,), dtype="float32") for i in range(12)]
    plan = PartitionPlan(params, 4)
    assert plan.shard_bytes == [1200, 1200, 1200, 1200]


def test_balance_within_four_thirds_of_optimum_bound() -> None:
    sizes = [700, 500, 400, 300, 300, 200, 100, 50]
    params = [ParamInfo(name=f"t{i}", shape=(n,), dtype="float32") for i, n in enumerate(sizes)]
    num_shards = 3
    plan = PartitionPlan(params, num_shards)
    lower_bound = max(
        sum(pc.nbytes for pc in plan.pieces) / num_shards, max(pc.nbytes for pc in plan.pieces)
    )
    assert max(plan.shard_bytes) <= 4 / 3 * lower_bound


def test_tensor_larger_than_fair_share_is_split_across_shards() -> None:
    params = [
        ParamInfo(name="embedding", shape=(1000, 16), dtype="float32"),
        ParamInfo(name="fc.weight", shape=(16, 10), dtype="float32"),
        ParamInfo(name="fc.bias", shape=(10,), dtype="float32"),
    ]
    num_shards = 4
    plan = PartitionPlan(params, num_shards)
    _check_coverage(plan)
    emb = [pc for pc in plan.pieces if pc.param.name == "embedding"]
    assert len(emb) >= num_shards
    assert len({pc.shard for pc in emb}) == num_shards
    assert all(not pc.whole and len(pc.shape) == 1 for pc in emb)
    total = sum(p.nbytes for p in params)
    assert max(plan.shard_bytes) <= total / num_shards + max(pc.nbytes for pc in plan.pieces)
    # Without splitting one shard would hold > 97% of the model.
    assert max(plan.shard_bytes) < 0.3 * total
    assert {pc.key for pc in emb} == {f"embedding#{pc.start}" for pc in emb}


def test_small_tensors_are_not_split() -> None:
    params = [ParamInfo(name=f"p{i}", shape=(10, 10), dtype="float32") for i in range(8)]
    plan = PartitionPlan(params, 4)
    assert all(pc.whole for pc in plan.pieces)
    assert len(plan.pieces) == 8


@settings(max_examples=50, deadline=None)
@given(params=param_lists, num_shards=st.integers(min_value=1, max_value=6))
def test_deterministic(params: list[ParamInfo], num_shards: int) -> None:
    a = PartitionPlan(params, num_shards)
    b = PartitionPlan(
        [ParamInfo(name=p.name, shape=p.shape, dtype=p.dtype) for p in params], num_shards
    )
    assert _plan_signature(a) == _plan_signature(b)
    assert a.shard_bytes == b.shard_bytes


def test_from_arrays_matches_param_infos() -> None:
    arrays = {"a": np.zeros((5, 7), np.float32), "b": np.zeros(3, np.int64)}
    infos = [
        ParamInfo(name="a", shape=(5, 7), dtype="float32"),
        ParamInfo(name="b", shape=(3,), dtype="int64"),
    ]
    assert _plan_signature(PartitionPlan.from_arrays(arrays, 2)) == _plan_signature(
        PartitionPlan(infos, 2)
    )


@settings(max_examples=50, deadline=None)
@given(params=param_lists)
def test_one_shard_keeps_whole_tensors(params: list[ParamInfo]) -> None:
    plan = PartitionPlan(params, 1)
    assert len(plan.pieces) == len(params)
    for p, pc in zip(params, plan.pieces, strict=True):
        assert pc.whole and pc.shard == 0
        assert pc.shape == p.shape
        assert pc.key == f"{p.name}#0"
    assert plan.shard_bytes == [sum(p.nbytes for p in params)]


def test_one_shard_keeps_huge_tensor_whole() -> None:
    plan = PartitionPlan([ParamInfo(name="big", shape=(4096, 64), dtype="float32")], 1)
    assert [(pc.start, pc.stop, pc.shape) for pc in plan.pieces] == [(0, 4096 * 64, (4096, 64))]


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        PartitionPlan([ParamInfo(name="a", shape=(1,), dtype="float32")], 0)
    with pytest.raises(ValueError, match="unique"):
        PartitionPlan(
            [
                ParamInfo(name="a", shape=(1,), dtype="float32"),
                ParamInfo(name="a", shape=(2,), dtype="float32"),
            ],
            2,
        )
