"""Sizes of the reference sublayers that need no torch: restopo.nn.flops reads them, and
`restopo inspect` prints FLOPs without importing torch."""
from __future__ import annotations

import math


def swiglu_hidden(d: int, ratio: float) -> int:
    """SwiGLU has three matrices, so its hidden size is 2/3 of ratio*d (the same parameter
    count as a two-matrix MLP of ratio*d), rounded up to a multiple of 8."""
    return 8 * math.ceil(2 * ratio * d / 3 / 8)
