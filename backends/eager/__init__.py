"""Plain-torch reference implementations of the aggregation ops: the `eager` backend, whose
depth_attention, phase1, phase2, depth_weights and rms_norm restopo.ops dispatches to."""
from .depth import depth_attention, depth_weights, logits_against, phase1, phase2
from .rmsnorm import rms_norm
from .weighted import gathered

__all__ = ["depth_attention", "depth_weights", "gathered", "logits_against", "phase1", "phase2",
           "rms_norm"]
