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
