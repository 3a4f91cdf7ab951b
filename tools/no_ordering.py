"""pytest plugin for tools/prove_stream_tests.sh only: removes the stream ordering (the
pre-contract behaviour): entry points queue on the engine stream and nothing waits either way,
and a foreign array is read through its __cuda_array_interface__ with no handshake with its
producer's stream (no DLPack `__dlpack__(stream=...)`, a v3 `stream` ignored)."""

import contextlib

from pydflash.device.runtime import Runtime, _attr, _without_grad

_as_device_array = Runtime.as_device_array


@contextlib.contextmanager
def _unordered(self):
    with self.device, self.stream:
        yield


def _no_handshake(self, obj, name):
    obj = _without_grad(obj)
    if _attr(obj, "__cuda_array_interface__") is not None:
        return self._from_cuda_array_interface(obj, name, ordered=True)
    return _as_device_array(self, obj, name)


Runtime.ordered = _unordered
Runtime.as_device_array = _no_handshake
