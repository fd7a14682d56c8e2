"""Plain-torch reference implementations of the aggregation ops: the `eager` backend, whose
depth_attention, phase1, phase2 (and phase2_norm), depth_weights and rms_norm restopo.ops
dispatches to, and `gained` (a query with its key-norm gain folded in) its bind_* use."""
from .depth import (depth_attention, depth_weights, gained, logits_against, phase1, phase2,
                    phase2_norm)
from .rmsnorm import rms_norm
from .weighted import gathered

__all__ = ["depth_attention", "depth_weights", "gained", "gathered", "logits_against",
           "phase1", "phase2", "phase2_norm", "rms_norm"]
