"""What rewire recovers from an existing PreNorm transformer, whatever way it was found.

A `Structure` splits a model's forward into the three pieces the residual stream runs
between: the front (everything before the first residual add: the embedding v_0, and the
values every sublayer reads besides the stream, such as rotary cos/sin or an attention
mask), the sublayers (v_l = f_l(h_l), the model's own PreNorm and attention or MLP), and the
back (the final norm, the LM head and whatever follows, such as the loss). The symbolic
tracer (restopo.fx.patterns) and the known-family builders (restopo.fx.hf) both produce one.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class RewireError(ValueError):
    """A model that rewire cannot take apart, with the reason and what is supported."""


class RewireWarning(UserWarning):
    """restopo.rewire's warnings (filter them with warnings.filterwarnings)."""


SUPPORTED = (
    "rewire supports PreNorm transformers, whose every sublayer adds into one residual "
    "stream as x = x + f(norm(x)) with f an attention or an MLP: models torch.fx can trace "
    "(such as a nanoGPT-style GPT), and these Hugging Face causal LMs: LlamaForCausalLM, "
    "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel")


@dataclass
class FrontAndBack:
    """The front and back of one call pattern of the model; each takes the original
    forward's arguments positionally, in signature order (`bind` gives them).

    front(*args) -> v_0, the embedding
    context(v_0, *args) -> the tuple passed after h to every sublayer (positions, masks)
    extra(*args) -> the tuple the back needs besides h (targets, labels, ...)
    back(h_{L+1}, *extra) -> the original model's output
    prepare(*args) -> args, run once per call first (fills in what the model's own forward
        would create, such as a KV cache), or None
    """

    front: Callable[..., Any]
    context: Callable[..., tuple]
    extra: Callable[..., tuple]
    back: Callable[..., Any]
    prepare: Callable[..., tuple] | None = None

    def arguments(self, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple:
        """This call's arguments in signature order, prepared."""
        values = bind(signature, args, kwargs)
        return values if self.prepare is None else tuple(self.prepare(*values))


@dataclass
class Structure:
    """A recovered PreNorm transformer.

    kinds      "attn" | "mlp" per sublayer, in order
    width      d, the residual stream's width
    sublayers  (h, *context) -> v_l, each with the model's own PreNorm inside
    names      where each sublayer lives in the original model (for messages and printing)
    ends       key -> FrontAndBack for the call pattern `key` (see `pattern`), built on
               first use
    signature  the original forward's signature (the rewired model keeps it)
    """

    kinds: tuple[str, ...]
    width: int
    sublayers: list[Callable]
    names: tuple[str, ...]
    ends: Callable[[tuple[str, ...]], FrontAndBack]
    signature: inspect.Signature
    family: str = "fx"
    vocab: int | None = None   # token ids for the self-check are drawn below it
    context_names: tuple[str, ...] | None = None  # how the lowered code names the context
    # (function, epsilon) of the norms called as functions (F.rms_norm), defaults filled in;
    # None for the dtype's machine epsilon
    function_norms: tuple[tuple[str, float | None], ...] = ()
    head_norm: bool = True  # the head reads h_{L+1} through a norm (a final norm)
    # GraphModules cut from a trace: they hold the model's buffers by reference, and a
    # buffer is replaced (not updated in place) when the model moves; see `resync`
    graph_modules: list = field(default_factory=list)

    def resync(self, model: nn.Module) -> None:
        """Point every buffer the traced pieces hold at the model's current tensor."""
        for gm in self.graph_modules:
            for name, buf in list(gm.named_buffers()):
                try:
                    current = operator.attrgetter(name)(model)
                except AttributeError:
                    continue
                if current is not buf and isinstance(current, torch.Tensor):
                    owner, _, leaf = name.rpartition(".")
                    gm.get_submodule(owner)._buffers[leaf] = current


class Recomputing:
    """Sublayer k of `source` (source.sublayer(k), for the model's current state), recomputed
    in backward while grad is on and source.recomputes(k) (while the original model, as it is
    now, would recompute it: rewire calls the sublayers past the blocks that checkpoint
    them). A plain object calling its source's methods, not closures, so that copy.deepcopy
    of a rewired model copies its source along with the model."""

    def __init__(self, source, k: int):
        self.source, self.k = source, k

    def __call__(self, h, *context):
        f = self.source.sublayer(self.k)
        if torch.is_grad_enabled() and self.source.recomputes(self.k):
            return checkpoint(f, h, *context, use_reentrant=False)
        return f(h, *context)


def bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple:
    """The call's arguments in signature order, defaults filled in (for the FrontAndBack)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


SCALARS = (bool, int, float, str)


def pattern(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple:
    """The arguments a trace is specialised on: ((name, value), ...) for every argument that
    is None or a Python scalar (bool, int, float, str), given or left at its default.

    Forward code branches on such values (nanoGPT's `if targets is not None`, HF's labels, a
    `return_loss` flag); each pattern is traced once, so the branch taken matches the call.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    out = []
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind in (inspect.Parameter.VAR_POSITIONAL,
                                               inspect.Parameter.VAR_KEYWORD):
            continue
        if value is None or type(value) in SCALARS:
            out.append((name, value))
    return tuple(out)
