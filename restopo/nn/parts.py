"""The contract between a model's pieces and the lowering.

`Parts` is what `restopo.fx.lower.lower` needs to know about a transformer: how tokens
become the first source v_0, the sublayers f_1..f_L (each with its PreNorm inside, so
v_l = f_l(h_l) is the raw output without any residual added), and how the last aggregation
h_{L+1} becomes logits. `restopo.fx.lower.lower(g, parts, backend="auto")` wires them as the
IR `g` says and returns a torch.fx GraphModule. restopo's own reference model
(restopo.nn.model) and rewired third-party models (restopo.fx.rewire) both hand their
pieces over in this form.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..words import counted


@dataclass
class Parts:
    """The pieces of a PreNorm transformer, without its residual stream.

    embed      idx [B, T] -> v_0 [B, T, d]
    sublayers  one module per sublayer; each maps (h [B, T, d], *context) -> v_l [B, T, d]
               with its PreNorm inside
    kinds      "attn" | "mlp" per sublayer (must match the IR's sublayer ops)
    head       h [B, T, d] -> logits (the final norm and the LM head inside)
    context    (idx, v_0) -> tuple of tensors passed, after h, to every sublayer (rotary
               cos/sin, masks, ...); None means sublayers take h alone
    context_names  optional names for the context tensors (e.g. ("cos", "sin")): they name
               the values in the generated code and fix their number; when None the lowering
               calls `context` once on a one-token input to count them
    """

    embed: nn.Module
    sublayers: nn.ModuleList
    kinds: tuple[str, ...]
    head: nn.Module
    context: nn.Module | None = None
    context_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        if not isinstance(self.sublayers, nn.ModuleList):
            self.sublayers = nn.ModuleList(self.sublayers)
        if len(self.sublayers) != len(self.kinds):
            raise ValueError(f"Parts has {counted(len(self.sublayers), 'sublayer')} but "
                             f"{counted(len(self.kinds), 'kind')}; give one kind per sublayer")
        bad = [k for k in self.kinds if k not in ("attn", "mlp")]
        if bad:
            raise ValueError(f"sublayer kinds must be 'attn' or 'mlp'; got {bad[0]!r}")
