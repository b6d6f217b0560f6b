"""The encoded mean of the collective path (runtime/encoded_mean.py), without processes."""

from __future__ import annotations

import numpy as np
import pytest

from distsgd.ps.compression import Encoding
from distsgd.runtime.encoded_mean import HEADER, NONFINITE, CorruptFrame, EncodedMean


def _values(workers: int, count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=count).astype(np.float32) for _ in range(workers)]


@pytest.mark.parametrize(
    ("encoding", "topk", "bound"),
    [(Encoding.INT8, 0.0, 1 / 127), (Encoding.INT4, 0.0, 1 / 7), (Encoding.INT2, 0.0, 1.0)],
)
def test_the_mean_is_the_mean_of_what_each_frame_carries(encoding, topk, bound) -> None:
    """Every worker's error is at most half a code step of its chunk's peak, so the mean's is
    within the mean of those; every worker computes the same bits."""
    values = _values(4, 1000)
    codecs = [EncodedMean(encoding, topk) for _ in values]
    frames = [c.encode("w", v) for c, v in zip(codecs, values, strict=True)]
    means = [c.mean(frames, 1000) for c in codecs]
    assert all(np.array_equal(means[0], m) for m in means[1:])
    exact = np.mean(values, axis=0)
    peak = max(float(np.abs(v).max()) for v in values)
    assert float(np.abs(means[0] - exact).max()) <= bound * peak / 2 + 1e-6
    assert not np.array_equal(means[0], exact)  # it did travel encoded


def test_frames_are_the_encodings_size_and_error_feedback_carries_the_rest() -> None:
    codec = EncodedMean(Encoding.INT4)
    assert codec.frame_nbytes(1280) == HEADER + 1280 // 2 + 10 * 4
    x = _values(1, 1280)[0]
    codec.encode("w", x)
    residual = codec.feedback.residual("w")
    assert residual is not None and float(np.abs(residual).max()) > 0
    # what was left out goes with the next frame: two sends of x carry 2x to within one step
    second = codec.mean([codec.encode("w", x)], 1280)
    first_only = EncodedMean(Encoding.INT4).mean([EncodedMean(Encoding.INT4).encode("w", x)], 1280)
    assert not np.array_equal(second, first_only)


def test_topk_frames_are_sparse_and_fixed_in_size() -> None:
    codec = EncodedMean(Encoding.RAW, 0.01)
    assert codec.planned_nnz(10_000) == 100
    assert codec.frame_nbytes(10_000) == HEADER + 100 * (4 + 4)
    values = _values(2, 10_000)
    mean = codec.mean([codec.encode("a", values[0]), codec.encode("b", values[1])], 10_000)
    assert 100 <= np.count_nonzero(mean) <= 200


def test_a_nonfinite_frame_makes_the_mean_nan() -> None:
    codec = EncodedMean(Encoding.INT8)
    bad = np.array([1.0, np.nan, 2.0, 3.0], dtype=np.float32)
    frame = codec.encode("w", bad)
    assert frame[0] == NONFINITE
    assert np.isnan(codec.mean([frame, codec.encode("v", np.ones(4, np.float32))], 4)).all()


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda f: f[:-1], "bytes"),
        (lambda f: np.concatenate([[Encoding.INT2], f[1:]]).astype(np.uint8), "encoding"),
        (lambda f: _with(f, 4, 7), "entries"),
        (lambda f: _with_scale(f, float("inf")), "scale"),
    ],
)
def test_a_peers_frame_is_checked_field_by_field(tamper, message) -> None:
    codec = EncodedMean(Encoding.INT8)
    frame = codec.encode("w", _values(1, 64)[0])
    with pytest.raises(CorruptFrame, match=message):
        codec.mean([frame, tamper(frame.copy())], 64)


def _with(frame: np.ndarray, at: int, value: int) -> np.ndarray:
    frame[at] = value
    return frame


def _with_scale(frame: np.ndarray, scale: float) -> np.ndarray:
    frame[8:16] = np.frombuffer(np.float64(scale).tobytes(), dtype=np.uint8)
    return frame
