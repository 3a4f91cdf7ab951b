"""The error types by kind: each under PydflashError and the builtin base callers catch today
(ValueError for what the caller passed, RuntimeError for what the device or NVRTC cannot do)."""

import pytest

from pydflash import errors


@pytest.mark.parametrize(
    "kind, base",
    [
        (errors.ArgumentError, ValueError),
        (errors.ShapeError, ValueError),
        (errors.GeometryError, errors.ShapeError),
        (errors.ConfigError, ValueError),
        (errors.CheckpointError, ValueError),
        (errors.CapacityError, ValueError),
        (errors.QuantizationError, ValueError),
        (errors.KernelCompileError, RuntimeError),
        (errors.NoDeviceError, errors.DeviceError),
        (errors.DeviceMemoryError, errors.DeviceError),
        (errors.UnsupportedDeviceError, errors.DeviceError),
        (errors.DeviceFaultError, errors.DeviceError),
        (errors.WrongDeviceError, errors.DeviceError),
        (errors.WrongDeviceError, ValueError),
        (errors.DeviceError, RuntimeError),
    ],
)
def test_every_kind_sits_under_pydflash_error_and_its_builtin(kind, base):
    assert issubclass(kind, errors.PydflashError) and issubclass(kind, base)


def test_argument_values_are_not_shape_errors():
    assert not issubclass(errors.ArgumentError, errors.ShapeError)
    assert not issubclass(errors.ShapeError, errors.ArgumentError)


def test_device_kinds_are_distinct():
    kinds = (
        errors.NoDeviceError,
        errors.DeviceMemoryError,
        errors.UnsupportedDeviceError,
        errors.DeviceFaultError,
    )
    for a in kinds:
        for b in kinds:
            assert issubclass(a, b) == (a is b)


def test_argument_errors_name_the_argument():
    from pydflash import philox
    from pydflash.draft.kv import DflashKv
    from pydflash.model.config import DflashCfg

    with pytest.raises(errors.ArgumentError, match="seed: expected an integer"):
        philox.state_words(1.5, 0)
    cfg = DflashCfg(
        hidden=64, n_head=2, n_kv=1, head_dim=32, n_ff=128, n_layer=1, eps=1e-6,
        rope_theta=1e4, block_size=4, mask_token_id=0, target_layer_ids=(0,),
    )  # fmt: skip
    with pytest.raises(errors.ArgumentError, match="dtype: K/V dtype must be one of"):
        DflashKv(None, cfg, 8, "fp8")


def test_cuda_errors_of_an_entry_point_become_device_fault_errors():
    """What a kernel fault surfaces as (CuPy's CUDA error at the next CUDA call) reaches the
    caller as DeviceFaultError carrying CUDA's text; pydflash's own errors pass unchanged."""
    cp = pytest.importorskip("cupy", reason="CuPy is needed to build its CUDA error")
    from pydflash.device.runtime import _device_faults

    with pytest.raises(errors.DeviceFaultError, match="illegal memory access.*restart"):
        with _device_faults():
            raise cp.cuda.runtime.CUDARuntimeError(700)  # cudaErrorIllegalAddress
    with pytest.raises(errors.ArgumentError, match="mine"):
        with _device_faults():
            raise errors.ArgumentError("mine")
