"""dev/gemm_bf16act_tiles.py's tiles against float64, with the checks the shipped tiles run
(tests/linear/test_gemm_bf16act_gpu.py's check_*: every element, tile edges, K splits, the silu_mul
epilogues, writes outside the output; skipped without a CUDA device)."""

import pytest

pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

from dev import gemm_bf16act_tiles as tiles  # noqa: E402
from tests.linear.test_gemm_bf16act_gpu import (  # noqa: E402
    SILU_CASES,
    SPLIT_CASES,
    STORE_CASES,
    check_silu_mul,
    check_split,
    check_store_partials,
)

TILES = [
    "w8_128x128_k32",
    "w4_128x128_k32",
    "w4_128x128_k64",
    "w8_128x256_k32",
    "tma_128x128_s3",  # sm_90 only (skipped elsewhere)
    "tma_128x256_s4",
]  # tiles.ALL_TILES, every one checked


def test_every_dev_tile_is_checked():
    assert set(TILES) == set(tiles.ALL_TILES)


@pytest.mark.parametrize("m,n,k,ksplit", STORE_CASES)
@pytest.mark.parametrize("tile", TILES)
def test_store_partials_match_float64(engine, rng, m, n, k, ksplit, tile):
    check_store_partials(engine, rng, m, n, k, ksplit, tile, tiles)


@pytest.mark.parametrize("m,n_ff,k", SILU_CASES)
@pytest.mark.parametrize("tile", TILES)
def test_silu_mul_matches_float64(engine, rng, m, n_ff, k, tile):
    check_silu_mul(engine, rng, m, n_ff, k, tile, tiles)


@pytest.mark.parametrize("m,n,k", SPLIT_CASES)
@pytest.mark.parametrize("tile", ["tma_128x128_s3"])
def test_split_partials_are_the_hi_and_lo_products(engine, rng, m, n, k, tile):
    check_split(engine, rng, m, n, k, tile, tiles)
