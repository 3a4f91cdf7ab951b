"""The GEMM launcher's rules without a GPU: its shared memory, its grid and the arguments it
refuses (fake device arrays stand in for CuPy's); where it runs: tests/linear/test_dispatch.py."""

import types

import numpy as np
import pytest

from pydflash.errors import ShapeError, UnsupportedDeviceError
from pydflash.linear import gemm


class FakeArray:
    """What the launcher reads of a CuPy array: dtype, shape, strides, data.ptr."""

    def __init__(self, shape, strides=None, dtype=np.float32, ptr=1 << 20):
        self.dtype, self.shape, self.ndim = np.dtype(dtype), tuple(shape), len(shape)
        item = self.dtype.itemsize
        self.strides = strides or tuple(
            item * int(np.prod(shape[i + 1 :])) for i in range(len(shape))
        )
        self.data = types.SimpleNamespace(ptr=ptr)

    def __getitem__(self, key):  # rows r0: (only the launcher's chunking slices)
        return self


def fake_rt(smem=227 * 1024):
    launches = []
    rt = types.SimpleNamespace(
        smem_per_block=smem, launch=lambda spec, grid, block, smem, **a: launches.append(grid)
    )
    return rt, launches


def fake_w(fmt="bf16", n=2048, k=4096):
    return types.SimpleNamespace(
        fmt=fmt,
        out_features=n,
        in_features=k,
        data=FakeArray((n, k), dtype=np.uint16),
        scales=None,
        tile_rows=0,
    )


def test_shared_memory_fits_every_target():
    # 99 KiB opt-in on sm_89 / sm_120, the smallest of the targets
    assert max(gemm.smem_bytes(f) for f in gemm.FORMATS) <= 99 * 1024
    assert gemm.FAMILY.defines["GEMM_SMEM_BF16"] == gemm.smem_bytes("bf16")


def test_grid_covers_the_output():
    rt, launches = fake_rt()
    w = fake_w(n=333)
    gemm.matmul(rt, w, FakeArray((1000, 4096)), 1000, FakeArray((1000, 333)))
    assert launches == [(3, 8)]
    gemm.matmul(rt, w, FakeArray((1000, 4096)), 0, FakeArray((1000, 333)))
    assert launches == [(3, 8)]  # m = 0: no launch


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(w=fake_w("f32")), "w"),
        (dict(x=FakeArray((1000, 4096), dtype=np.float64)), "x"),
        (dict(x=FakeArray((999, 4096))), "x"),
        (dict(x=FakeArray((1000, 4096), ptr=(1 << 20) + 4)), "x"),
        (dict(x=FakeArray((1000, 4096), strides=(4098 * 4, 4))), "x"),
        (dict(x=FakeArray((1000, 4096), strides=(4096 * 4, 8))), "x"),
        (dict(out=FakeArray((1000, 2047))), "out"),
        (dict(out=FakeArray((1000,))), "out"),
        (dict(m=-1), "m"),
        (dict(m=True), "m"),
    ],
)
def test_refusals_name_the_argument(change, name):
    rt, launches = fake_rt()
    args = dict(w=fake_w(), x=FakeArray((1000, 4096)), m=1000, out=FakeArray((1000, 2048)))
    args.update(change)
    with pytest.raises(ShapeError, match=f"^{name}[: ]"):
        gemm.matmul(rt, args["w"], args["x"], args["m"], args["out"])
    assert not launches


def test_no_room_is_a_device_error():
    rt, launches = fake_rt(64 * 1024)
    with pytest.raises(UnsupportedDeviceError, match="shared memory"):
        gemm.matmul(rt, fake_w(), FakeArray((300, 4096)), 300, FakeArray((300, 2048)))
    assert not launches
