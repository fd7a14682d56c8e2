"""Plain-torch reference implementations of the aggregation ops: the `eager` backend, whose
depth_attention, phase1, phase2 and depth_weights restopo.ops dispatches to."""
from .depth import depth_attention, depth_weights, phase1, phase2

__all__ = ["depth_attention", "depth_weights", "phase1", "phase2"]
