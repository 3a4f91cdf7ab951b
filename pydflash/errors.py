"""Exception types. Every message names the tensor, key, shape or argument at fault."""

import re


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


class ArgumentError(PydflashError, ValueError):
    """An argument's value is out of its domain: an option not among those accepted, a number
    out of range or not finite, a flag that is not a bool, an object of the wrong kind."""


class GeometryError(ShapeError):
    """The drafter's geometry lies outside what the GPU kernels support (docs/limits.md "Supported
    envelope"); the message names every dimension at fault and the kernel that needs it."""


class CapacityError(PydflashError, ValueError):
    """An operation would write past the capacity of a DflashKv."""


class KernelCompileError(PydflashError, RuntimeError):
    """NVRTC rejected a cuda_src file; the message carries the file name and the NVRTC log."""


class DeviceError(PydflashError, RuntimeError):
    """The CUDA device cannot do what was asked (the subclasses say why)."""


class NoDeviceError(DeviceError):
    """No usable CUDA device: CuPy is not installed, no device is visible, or the ordinal is
    out of range."""


class DeviceMemoryError(DeviceError):
    """The device (or the page-locked host memory that stages copies to it) cannot hold the
    allocation asked for (the message gives what was asked, and what is free where known)."""


class UnsupportedDeviceError(DeviceError):
    """The device lacks a capability the call needs (an architecture, a launch API, shared
    memory for a kernel's tile)."""


MAX_LISTED = 100  # problems a message lists in full (a hostile header can make 100k)
MAX_LINE = 300  # characters of one problem (a tensor name can be megabytes)


def collected(source: object, problems: list[str]) -> str:
    """The message of an error reporting several problems: 'SOURCE: N problem(s):' then one
    indented line each, the first MAX_LISTED of them, each cut to MAX_LINE characters."""
    lines = [p if len(p) <= MAX_LINE else p[: MAX_LINE - 3] + "..." for p in problems]
    if len(lines) > MAX_LISTED:
        lines = lines[:MAX_LISTED] + [f"... and {len(lines) - MAX_LISTED} more"]
    return f"{source}: {len(problems)} problem(s):\n  " + "\n  ".join(lines)


_HEAD = re.compile(r"(?P<source>.*?): (?P<what>[^:]*?)\(?\d+ problem\(s\)\)?:")


def problem_lines(exc: BaseException) -> list[str]:
    """One line per problem an error reports: the collected form 'SOURCE: N problem(s):' with
    one indented problem a line becomes 'SOURCE: problem' lines; any other message is one
    line (its line breaks folded). For tools that print a line per problem."""
    head, _, rest = str(exc).partition("\n")
    m = _HEAD.fullmatch(head)
    if m and rest:
        return [f"{m['source']}: {line.strip()}" for line in rest.splitlines() if line.strip()]
    return [" | ".join(part.strip() for part in str(exc).splitlines() if part.strip())]


class DeviceFaultError(DeviceError):
    """The device reported an error while running queued work (a kernel that faulted, an
    illegal address): the message carries CUDA's text, and the kernel's name where the engine
    synchronises after every launch (Engine(debug_sync=True)). A fault poisons the process's
    CUDA context: every later call fails the same way until the process restarts."""


class WrongDeviceError(DeviceError, ValueError):
    """An array, DflashKv, pool or engine the call was given lives on another device than the
    drafter's (the message names the argument and both devices); pydflash never reads across
    devices silently."""
