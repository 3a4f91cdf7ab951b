"""pydflash.device.tensormap's refusals and the TensorMap kernel parameter (CPU: the encoding itself
needs the driver and runs in tests/linear/test_gemm_bf16act_gpu.py's TMA tiles)."""

import pytest

from pydflash.device import kernels, tensormap
from pydflash.errors import ShapeError


def test_bf16_rows_reports_every_problem_before_the_driver():
    with pytest.raises(ShapeError) as err:
        tensormap.bf16_rows(0x1008, 0, 12, 512)
    msg = str(err.value)
    for part in ("16-byte aligned", "multiple of 16 bytes", "dims 0 x 12", "box 512 x 64"):
        assert part in msg, part


def test_tensor_map_parameters_cast_and_match_their_ptx_declaration():
    (m, n) = kernels.parse_signature("TensorMap wmap, int n")
    assert m.is_struct and not n.is_struct and m.ptx_type == ".b8[128]"
    spec = kernels.Family("x").kernel("k", "TensorMap wmap, int n")
    good = tensormap.TensorMap(bytes(range(128)))
    assert spec.args({"wmap": good, "n": 3})[0] == good
    with pytest.raises(ShapeError, match="wmap: expected 128 bytes"):
        spec.args({"wmap": b"\0" * 64, "n": 3})
    ptx = ".entry k(\n .param .align 64 .b8 k_param_0[128],\n .param .u32 k_param_1\n)"
    assert kernels.ptx_entries(ptx) == {"k": [".b8[128]", ".u32"]}
    assert spec.takes_structs and spec.family.has_structs
    plain = kernels.Family("y").kernel("k", "const float* x, int n")
    assert not plain.takes_structs and not plain.family.has_structs


def test_u8_rows_reports_every_problem_before_the_driver():
    with pytest.raises(ShapeError) as err:
        tensormap.u8_rows(0x1004, 5, 24, 300, 40)
    msg = str(err.value)
    for part in ("16-byte aligned", "row of 24 bytes", "box 300 x 40"):
        assert part in msg, part


def _box(flat, elem, dims, strides, box, coords):
    """A NumPy model of a tiled TMA copy: the box at `coords` (innermost first) of the tensor
    of `dims` / byte `strides` over the bytes `flat`, in shared-memory order (the last box dim
    slowest), elements past a dim's end zero (the swizzle is box_swizzle's, tested apart)."""
    import itertools

    import numpy as np

    out = []
    for idx in itertools.product(*(range(b) for b in reversed(box))):
        g = [c + i for c, i in zip(coords, reversed(idx))]
        if any(x >= d for x, d in zip(g, dims)):
            out.append(np.zeros(elem, np.uint8))
            continue
        off = g[0] * elem + sum(x * s for x, s in zip(g[1:], strides))
        out.append(flat[off : off + elem])
    return np.concatenate(out)


def test_tiled_maps_copy_the_rows_the_tiles_expect(rng):
    """tiles_geometry (u8_tiles', bf16_tiles' view of formats.layout's planes), at the
    coordinates the launchers give: gemm_quant's box is [128 / tr tiles][2 chunks][tr rows]
    [a block's bytes] of weight rows n0.. and K tile kt; gemm_bf16act_tma's is one chunk's
    [BN rows][32 bf16]; rows past the last tile read as zeros."""
    import numpy as np

    from pydflash.formats import layout

    tr, chunks = 64, 6
    for rb, elem in ((32, 1), (16, 1), (64, 2)):  # q8_0, q4_0 bytes; bf16 elements
        n = 200  # 4 tiles, the last one partly padding
        planes = rng.integers(0, 256, (n, chunks * rb), dtype=np.uint8)
        flat, _ = layout.tile_planes(planes, None, tr, rb)
        tiles = -(-n // tr)
        box_chunks = 1 if elem == 2 else 2
        dims, strides, box = tensormap.tiles_geometry(tiles, chunks, tr, rb, elem, box_chunks)
        box = (*box[:3], 128 // tr)
        for n0, c in ((0, 0), (128, 2), (128, 5)):  # the second block: tiles 2 and 3 (+ none)
            got = _box(flat, elem, dims, strides, box, (0, 0, c, n0 // tr)).reshape(
                128 // tr, box_chunks, tr, rb
            )
            for t in range(128 // tr):
                for j in range(box_chunks):
                    rows = np.arange(n0 + t * tr, n0 + (t + 1) * tr)
                    want = np.zeros((tr, rb), np.uint8)
                    real = rows < n
                    if c + j < chunks:
                        want[real] = planes[rows[real], (c + j) * rb : (c + j + 1) * rb]
                    np.testing.assert_array_equal(got[t, j], want, err_msg=f"{rb} {n0} {c} {t}")
