"""pydflash: DFlash / DSpark block-diffusion drafters on NVIDIA GPUs, without torch.

The GPU API mirrors Rust `memra_engine::dflash` one to one (Engine, DflashDraft, DflashKv,
DflashCfg, DflashLayer, MarkovHead, GpuTensor); `pydflash.reference` is the NumPy oracle.
GPU classes import lazily so the CPU parts work where CuPy is absent.
"""

from .checkpoint import Checkpoint
from .checks import FROM_CONFIG
from .config import DflashCfg
from .errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    DeviceError,
    GeometryError,
    KernelCompileError,
    PydflashError,
    QuantizationError,
    ShapeError,
)
from .reference import ReferenceDraft, ReferenceKv
from .rope import RopeSpec

__version__ = "0.1.0"

_GPU = {
    "Engine": "engine",
    "GpuTensor": "tensor",
    "DflashDraft": "draft",
    "DflashLayer": "weights",
    "MarkovHead": "weights",
    "DflashKv": "kv",
    "DflashBatchKv": "batch_kv",
    "Proposal": "draft_step",
    "Verdict": "verify",
}


def __getattr__(name: str):
    if name in _GPU:
        import importlib

        return getattr(importlib.import_module(f".{_GPU[name]}", __name__), name)
    raise AttributeError(f"module 'pydflash' has no attribute {name!r}")


__all__ = [
    "FROM_CONFIG",
    "Checkpoint",
    "DflashCfg",
    "RopeSpec",
    "ReferenceDraft",
    "ReferenceKv",
    "PydflashError",
    "ConfigError",
    "CheckpointError",
    "GeometryError",
    "QuantizationError",
    "ShapeError",
    "CapacityError",
    "KernelCompileError",
    "DeviceError",
    *_GPU,
]
