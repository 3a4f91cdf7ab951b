"""sampling.cu: token choice from logits rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

ARGMAX_THREADS = 1024

FAMILY = Family("sampling")
ARGMAX_ROWS = FAMILY.kernel("argmax_rows", "const float* x, long long ldx, int n, int* out")


def argmax_rows(rt: Runtime, x: Any, out: Any, rows: int, n: int) -> None:
    """out[r] = argmax of row r of x (ties: lowest index; NaN never wins)."""
    if rows:
        rt.launch(ARGMAX_ROWS, (rows,), ARGMAX_THREADS, x=x, ldx=x.strides[0] // 4, n=n, out=out)
