"""Exception types. Every message names the tensor, key, shape or argument at fault."""


class PydflashError(Exception):
    """Base class of every error pydflash raises on purpose."""


class ConfigError(PydflashError, ValueError):
    """config.json is missing, unreadable, or has a missing/invalid key."""


class CheckpointError(PydflashError, ValueError):
    """The checkpoint directory or one of its tensors is missing, corrupt or misshapen."""


class QuantizationError(PydflashError, ValueError):
    """A weight cannot be stored in the requested block format."""


class ShapeError(PydflashError, ValueError):
    """An argument has the wrong shape, length, dtype or device."""


class GeometryError(ShapeError):
    """The drafter's geometry lies outside what the GPU kernels support (README "Supported
    envelope"); the message names every dimension at fault and the kernel that needs it."""


class CapacityError(PydflashError, ValueError):
    """An operation would write past the capacity of a DflashKv."""


class KernelCompileError(PydflashError, RuntimeError):
    """NVRTC rejected a cuda_src file; the message carries the file name and the NVRTC log."""


class DeviceError(PydflashError, RuntimeError):
    """No usable CUDA device, or CuPy is not installed."""
