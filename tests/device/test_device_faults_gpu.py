"""A kernel that faults (a write to an unmapped address), in a child process since a fault
poisons the CUDA context for good: the next public call raises DeviceFaultError carrying
CUDA's text, never a hang; with Engine(debug_sync=True) the launch itself raises, naming the
kernel (skipped without a CUDA device)."""

import subprocess
import sys
import textwrap

import pytest

from pydflash.device.runtime import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")

CHILD = textwrap.dedent(
    """
    import cupy as cp, numpy as np
    from pydflash import Engine
    from pydflash.errors import DeviceFaultError
    from pydflash.ops import elementwise

    e = Engine(0, debug_sync={debug})
    n = 1 << 20
    a, b = e.htod(np.ones(n, np.float32)), e.htod(np.ones(n, np.float32))
    unmapped = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(0x10000, 4 * n, None, 0), 0)
    out = cp.ndarray((n,), np.float32, unmapped)
    try:
        with e.stream:
            elementwise.add(e, a, b, out, n)  # queued: faults on the device
        e.dtoh(a)  # the next public call
    except DeviceFaultError as exc:
        print("FAULT", exc)
    else:
        print("NO ERROR")
    """
)


def run_child(debug: bool) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(debug=debug)],
        capture_output=True,
        text=True,
        timeout=180,  # never a hang
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_fault_is_reported_at_the_next_call_with_cudas_text():
    out = run_child(debug=False)
    assert out.startswith("FAULT"), out
    assert "illegal" in out.lower() or "address" in out.lower(), out
    assert "restart the process" in out


def test_debug_sync_names_the_kernel_that_faulted():
    out = run_child(debug=True)
    assert out.startswith("FAULT add_f32: the kernel faulted"), out
