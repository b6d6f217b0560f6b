"""The parameter server's numeric kernels (``distsgd.ps.rules``): the finiteness check every
push passes and the in-place ``axpy`` of the update rules, against plain numpy, at sizes below
and across their block sizes."""

from __future__ import annotations

import numpy as np
import pytest

from distsgd.ps.rules import BLOCK, FINITE_BLOCK, all_finite, axpy

SIZES = [0, 1, 7, BLOCK - 1, BLOCK + 3, FINITE_BLOCK, 2 * FINITE_BLOCK + 5]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_finds_any_nan_or_inf_anywhere(size: int, dtype: type) -> None:
    rng = np.random.default_rng(size)
    array = rng.standard_normal(size).astype(dtype)
    assert all_finite(array)
    if size == 0:
        return
    big = np.finfo(dtype).max
    for where in {0, size // 2, size - 1}:
        for bad in (np.nan, np.inf, -np.inf):
            spoiled = array.copy()
            spoiled[where] = bad
            assert not all_finite(spoiled), (where, bad)
        spoiled = array.copy()
        spoiled[where] = big  # the largest finite value is finite
        assert all_finite(spoiled)


def test_all_finite_on_shapes_and_non_contiguous_views() -> None:
    array = np.ones((300, 7001), np.float32)
    assert all_finite(array) and all_finite(array[:, ::3]) and all_finite(array.T)
    array[299, 6999] = np.nan
    assert not all_finite(array) and not all_finite(array[:, ::3]) and not all_finite(array.T)
    assert all_finite(array[:, ::2])  # the NaN is in an odd column


@pytest.mark.parametrize("size", SIZES)
def test_axpy_equals_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    values = rng.standard_normal(size).astype(np.float32)
    x = rng.standard_normal(size).astype(np.float32)
    expected = values + np.float32(-0.01) * x
    axpy(values, -0.01, x)
    np.testing.assert_array_equal(values, expected)
