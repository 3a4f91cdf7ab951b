"""Read a small tensor file written by `torch.save` without torch (and without running any
pickled code): the zip archive of torch's serialization (`<name>/data.pkl` plus one
`<name>/data/<key>` entry per storage), unpickled by a restricted Unpickler that knows only
the globals a plain tensor save uses (`torch._utils._rebuild_tensor_v2` / `_rebuild_parameter`,
the typed storage classes, `collections.OrderedDict`); any other global is refused by name.

A drafter's `mask_embedding.pt` (vLLM / SGLang's learned MASK row) is such a file: a bare tensor,
or a dict {"embedding": tensor, "mask_token_id": int}. The result is a dict or a NumPy array
(bf16 tensors as ml_dtypes.bfloat16); the legacy (pre-zip) format is refused.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

MAX_FILE_BYTES = 64 << 20  # a mask row is hidden x 4 bytes; a slot per row at most ~1 MB
MAX_PICKLE_BYTES = 1 << 20

_STORAGES = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
}


class _Storage:
    def __init__(self, dtype: np.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.source = archive, prefix, source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, requires_grad, hooks: data
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise CheckpointError(
            f"{self.source}: refers to {module}.{name}, which a plain tensor file does not "
            "(only saved tensors and dicts of them are read)"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.source}: unknown persistent id {pid!r:.60}")
        dtype, key, numel = pid[1], pid[2], pid[4]
        if (
            not isinstance(dtype, np.dtype)
            or not isinstance(key, str)
            or not isinstance(numel, int)
        ):
            raise CheckpointError(f"{self.source}: malformed storage record {pid!r:.60}")
        return _Storage(dtype, key, numel)

    def _rebuild_tensor(
        self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any
    ) -> np.ndarray:
        if not isinstance(storage, _Storage):
            raise CheckpointError(f"{self.source}: a tensor without a storage")
        if not (
            isinstance(offset, int)
            and isinstance(size, tuple)
            and isinstance(stride, tuple)
            and len(size) == len(stride) <= 4
            and all(isinstance(v, int) and v >= 0 for v in (offset, *size, *stride))
        ):
            raise CheckpointError(f"{self.source}: malformed tensor record")
        name = f"{self.prefix}data/{storage.key}"
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise CheckpointError(f"{self.source}: no storage entry {name!r}") from None
        item = storage.dtype.itemsize
        if info.file_size != storage.numel * item:
            raise CheckpointError(
                f"{self.source}: storage {storage.key} holds {info.file_size} bytes, its record "
                f"says {storage.numel} x {item}"
            )
        last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else -1
        if last >= storage.numel:
            raise CheckpointError(f"{self.source}: a tensor reaches past its storage")
        flat = np.frombuffer(self.archive.read(name), dtype=storage.dtype)
        if not all(size):
            return np.zeros(size, storage.dtype)
        view = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=size, strides=tuple(s * item for s in stride)
        )
        return np.array(view)  # a contiguous copy


def load(path: str | Path) -> Any:
    """The object `torch.save` wrote to `path` (tensors as NumPy arrays), or a CheckpointError
    naming the file and what is wrong."""
    path = Path(path)
    source = str(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{source}: cannot read ({exc.strerror})") from None
    if size > MAX_FILE_BYTES:
        raise CheckpointError(f"{source}: {size} bytes, more than a tensor file here may hold")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise CheckpointError(
            f"{source}: not a torch zip archive (the legacy torch.save format is not read; "
            "re-save it with a current torch)"
        ) from None
    with archive:
        pkls = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointError(f"{source}: expected one <name>/data.pkl entry, found {pkls}")
        prefix = pkls[0][: -len("data.pkl")]
        order = prefix + "byteorder"
        if order in archive.namelist() and archive.read(order).strip() not in (b"little", b""):
            raise CheckpointError(f"{source}: big-endian tensors are not read")
        info = archive.getinfo(pkls[0])
        if info.file_size > MAX_PICKLE_BYTES:
            raise CheckpointError(f"{source}: its pickle is {info.file_size} bytes")
        try:
            return _Unpickler(archive.read(pkls[0]), archive, prefix, source).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed pickle is this file's fault
            raise CheckpointError(f"{source}: not a readable tensor file ({exc})") from None
