"""The split exponentials of the Gluon kernels' softmax (attention.softmax_exp2), without a GPU: the cubic's
error bound over the whole range the softmax feeds it, the edge values (a masked key's -inf, NaN, the float32
exponent's floor), which lanes go where, and the PTX's shape. The kernels that use it are checked against float64
on an H200 (tests/kernels/test_attention_gpu.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from guardlint.kernels.attention import softmax_exp2 as se


def test_the_cubic_is_within_its_stated_relative_error_on_every_normal_result():
    x = np.concatenate([np.linspace(-126.0, 0.0, 400_001, dtype=np.float32),
                        -np.random.default_rng(0).exponential(3.0, 100_000).astype(np.float32).clip(0, 126)])
    got = se.reference(x[:, None].repeat(8, 1), 8, 8)[:, 0].astype(np.float64)
    exact = np.exp2(x.astype(np.float64))
    assert np.abs(got / exact - 1).max() <= 8e-5


def test_edges_masked_keys_nan_and_the_exponent_floor():
    x = np.array([[-np.inf, np.nan, -127.0, -126.6, -200.0, -1e30, 0.0, -0.5]], dtype=np.float32)
    got = se.reference(x, 8, 8)[0]
    assert got[0] == 0.0  # a masked key: exactly zero, as ex2.approx.ftz gives
    assert math.isnan(got[1])  # NaN stays NaN
    assert got[2] == 0.0 and got[4] == 0.0 and got[5] == 0.0
    assert 0 <= got[3] <= 2.0 ** -126  # rounds to j = -127: below the smallest normal
    assert abs(got[6] - 1.0) <= 8e-5 and abs(got[7] - 2 ** -0.5) <= 8e-5 * 2 ** -0.5


@pytest.mark.parametrize("pack,poly,lanes", [(8, 1, [4]), (8, 2, [2, 6]), (8, 3, [1, 3, 6]), (8, 4, [1, 3, 5, 7]),
                                             (4, 1, [2]), (8, 0, [])])
def test_lanes_are_spread_over_the_pack(pack, poly, lanes):
    assert se.poly_lanes(pack, poly) == lanes


def test_a_poly_count_outside_the_pack_is_refused():
    with pytest.raises(ValueError, match=r"poly must be in \[0, 8\], got 9"):
        se.poly_lanes(8, 9)


@pytest.mark.parametrize("poly", [0, 1, 2, 3, 4])
def test_the_ptx_sends_each_lane_to_its_unit(poly):
    text = se.asm(8, poly)
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    mufu = [line for line in lines if line.startswith("ex2.approx.ftz.f32")]
    assert len(mufu) == 8 - poly and text.count("max.NaN.f32") == poly
    # every output written exactly once, from its own input
    for i in range(8):
        writes = [line for line in lines if line.split(" ", 1)[-1].startswith(f"${i},")]
        assert len(writes) == 1
        assert (f"${8 + i}" in writes[0]) == (i not in se.poly_lanes(8, poly))
    assert se.constraints(8) == ",".join(["=r"] * 8 + ["r"] * 8)


def _bf16(p: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (round to nearest even) -> float32, as the kernel rounds P for its P V product."""
    bits = p.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("poly", [2, 3, 4, 8])
def test_attention_with_split_exponentials_is_as_accurate_as_with_exact_ones(poly):
    """softmax(Q K^T / sqrt(D)) V for one head, in float32 with P's exponentials split as the kernel splits them
    and P rounded to bf16 for the P V product: against float64, its error is that of P's rounding (the cubic's
    7.5e-5 is 50x below bf16's half unit), within 2% of the same computation with exact exponentials."""
    rng = np.random.default_rng(poly)
    q, k, v = (rng.standard_normal((256, 80)).astype(np.float32) for _ in range(3))
    x = (q @ k.T) * np.float32(3 * 80 ** -0.5 * math.log2(math.e))  # sharp rows: exponents below -30
    x = (x - x.max(1, keepdims=True)).astype(np.float32)
    e = np.exp2(x.astype(np.float64))
    exact = (e @ v.astype(np.float64)) / e.sum(1)[:, None]

    def error(p):
        d = np.abs((_bf16(p) @ v) / p.sum(1, keepdims=True) - exact)
        return d.max(), d.mean()

    (max_split, mean_split), (max_mufu, mean_mufu) = error(se.reference(x, 8, poly)), error(se.reference(x, 8, 0))
    assert mean_split <= 1.02 * mean_mufu and max_split <= 1.05 * max_mufu
    assert x.min() < -30
