"""pydflash: DFlash / DSpark block-diffusion drafters on NVIDIA GPUs, without torch.

The GPU API mirrors Rust `memra_engine::dflash` one to one (Engine, DflashDraft, DflashKv,
DflashCfg, DflashLayer, MarkovHead, GpuTensor); `pydflash.reference` is the NumPy oracle.
GPU classes import lazily so the CPU parts work where CuPy is absent.
"""

from .checks import FROM_CONFIG
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
from .io.checkpoint import Checkpoint
from .model.config import DflashCfg
from .model.rope import RopeSpec
from .reference.drafter import ReferenceDraft, ReferenceKv

__version__ = "0.1.0"

_GPU = {
    "Engine": "device.engine",
    "GpuTensor": "formats.tensor",
    "DflashDraft": "draft.drafter",
    "DflashLayer": "draft.weights",
    "MarkovHead": "draft.weights",
    "DflashKv": "draft.kv",
    "DflashBatchKv": "draft.batch_kv",
    "Proposal": "draft.step",
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
