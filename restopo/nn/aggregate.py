"""The aggregation modules: one per aggregation node of the IR (h_l from its sources).

Each is built from the node (restopo.ir.Aggregation) by `make_aggregation`. Direct modules
take the node's sources in IR order (`forward(*sources)`); stream modules (rezero,
layerscale, highway) take the running value and the newest output (`forward(h_prev,
v_prev)`) so the model keeps one live value per token. `TwoPhase` runs phase 1 for a group
of attend modules that read the same completed blocks; the parameters stay owned by the
member modules.

Every aggregation module answers `input_weights(*inputs)`: the weight of each of its
inputs, broadcastable to it, with forward(*inputs) == sum_i w_i * inputs_i. Diagnostics
read a module's depth weights through that one method, never by re-deriving its maths.
Multi-stream modules (restopo.nn.streams) answer `coefficients(x)` -> (pre, post, R)
instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ir import Aggregation
from ..topology import STREAM_METHODS
from .norm import NORM_EPS
from .streams import make_stream_module

EPS = NORM_EPS


def own(module: nn.Module, name: str):
    """The parameter (or submodule) `name` of `module`, read from its own dict: a plain
    `module.name` goes through nn.Module.__getattr__, about a microsecond a lookup, and a
    decoding step's aggregation points read a dozen each (it was most of the Python time of
    a phase 1 there). Anything not in those dicts is read as an attribute."""
    got = module._parameters.get(name)
    if got is None:
        got = module._modules.get(name)
    return getattr(module, name) if got is None else got


# The decoding sequence now running (restopo.decode sets it around each step), None outside
# one. A sequence's parameters are fixed (its KV caches hold keys and values made with them),
# so derived() checks a kept value's parameters once per sequence, not at every step.
FIXED_FOR: list = [None]


def derived(owner: nn.Module, params: tuple[torch.Tensor, ...], make, slot: str = "derived"):
    """make(), kept on `owner` (in its Kept, under `slot`) while `params` are unchanged,
    for calls autograd does not record (decoding, evaluation). There, remaking a
    pseudo-query's gained form at every aggregation point of every step is pure dispatch
    cost. The key is each parameter's storage, dtype, device and version (bumped by every
    in-place update: an optimizer step, load_state_dict), so a changed parameter is never
    served a stale value; within a decoding sequence (FIXED_FOR) it is checked at the
    sequence's first step only (touching every parameter's storage and version counter
    costs more than the kernel there, once the step's matmuls have pushed them out of the
    caches)."""
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return make()
    cache = owner.__dict__.get("_kept")
    if cache is None:
        cache = owner.__dict__["_kept"] = Kept()
    kept, sequence = cache.get(slot), FIXED_FOR[0]
    if kept is not None and sequence is not None and kept[2] is sequence:
        return kept[1]
    key = tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in params)
    if kept is None or kept[0] != key:
        kept = (key, make(), sequence)
    cache[slot] = (kept[0], kept[1], sequence)
    return kept[1]


def trusted(owner: nn.Module, slot: str):
    """What derived() keeps on `owner` under `slot` when it was checked in the decoding
    sequence now running (FIXED_FOR), else None: a step after the sequence's first then
    skips even gathering the parameters a check would read."""
    sequence = FIXED_FOR[0]
    cache = None if sequence is None else owner.__dict__.get("_kept")
    kept = None if cache is None else cache.get(slot)
    return kept[1] if kept is not None and kept[2] is sequence else None


class Kept(dict):
    """What derived() keeps on a module, by slot: a cache, so a copy or a pickle of the
    module (copy.deepcopy, torch.save) starts with an empty one; what it holds (bound
    kernel calls, closures) can be neither copied nor pickled."""

    def __reduce__(self):
        return Kept, ()


def unrecorded() -> bool:
    """True for calls autograd does not record and dynamo does not trace (eager decoding,
    evaluation): there the aggregation modules run kernel calls bound once per parameter
    version (ops.bind_*), where a one-token step's cost is mostly the call path."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class Attend(nn.Module):
    """AttnRes depth attention: h = sum_i alpha_i v_i, alpha from pseudo_query . RMSNorm(v_i).

    `pseudo_query` starts at zero, so a fresh model takes the plain mean of the sources
    (softmax gate). With `query="input_dependent"` the query is
    `pseudo_query + W(rmsnorm(newest source))` per token; W starts at zero, so at
    initialisation it equals the static query and only learns to depart from it.
    """

    def __init__(self, d: int, query: str = "static", gate: str = "softmax",
                 key_norm: str = "rms", heads: int = 1, backend: str = "auto"):
        super().__init__()
        if d % heads:
            raise ValueError(f"depth heads must divide the width: width {d}, heads {heads}")
        self.d, self.query, self.gate, self.heads, self.backend = d, query, gate, heads, backend
        self.pseudo_query = nn.Parameter(torch.zeros(d))
        self.key_norm = nn.RMSNorm(d, eps=EPS) if key_norm == "rms" else None
        self.query_proj = None
        if query == "input_dependent":
            self.query_proj = nn.Linear(d, d, bias=False)
            nn.init.zeros_(self.query_proj.weight)

    @property
    def gain(self) -> torch.Tensor | None:
        return None if self.key_norm is None else self.key_norm.weight

    def forward(self, *sources: torch.Tensor, phase1=None, slot: int = 0,
                norm_weight: torch.Tensor | None = None,
                norm_eps: float | None = None, logits=None) -> torch.Tensor:
        """`logits`: each source's logit, already made (restopo.nn.shared_sources)."""
        if phase1 is not None:
            return self.merge(phase1, slot, sources[0] if sources else None, norm_weight,
                              norm_eps)
        if (self.query_proj is None and self.gate == "softmax" and logits is None
                and unrecorded()):
            return self._bound("attend", (), lambda q, gain, key_norm:
                               ops.bind_depth_attention(q, gain, EPS, key_norm=key_norm,
                                                        heads=self.heads,
                                                        backend=self.backend))(sources)
        q, gain = self._static() if self.query_proj is None else (self._query(sources),
                                                                   self.gain)
        # A tuple, not a stack: the eager backend then saves no copy of the sources.
        return ops.depth_attention(sources, q, gain, EPS,
                                   key_norm=self.key_norm is not None, gate=self.gate,
                                   heads=self.heads, backend=self.backend, logits=logits)

    def runs_kernels(self, device, dtype) -> bool:
        """Whether this module's calls (uncompiled) run the cpu backend's fused C kernels:
        regional compilation then leaves it uncompiled (restopo.train.compile)."""
        return (self.query_proj is None and self.gate == "softmax"
                and ops.cpu_kernels(self.backend, device, dtype))

    def _query(self, sources) -> torch.Tensor:
        q = self.pseudo_query
        if self.query_proj is not None:
            q = q + self.query_proj(F.rms_norm(sources[-1], (self.d,), eps=EPS))
        return q

    def _bound(self, slot: str, extra: tuple, bind):
        """bind(pseudo_query, key-norm gain or None, key_norm), kept under `slot` while those
        and the `extra` tensors it binds are unchanged (see derived)."""
        got = trusted(self, slot)
        if got is not None:
            return got
        q, norm = own(self, "pseudo_query"), own(self, "key_norm")
        gain = None if norm is None else own(norm, "weight")
        params = (q,) + extra if gain is None else (q, gain) + extra
        return derived(self, params, lambda: bind(q, gain, norm is not None), slot)

    def _static(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the pseudo-query, the key-norm gain); without autograd, the gain folded into
        the query once while both are unchanged (the backends fold it per call otherwise)."""
        q, norm = own(self, "pseudo_query"), own(self, "key_norm")
        gain = None if norm is None else own(norm, "weight")
        if gain is None or torch.is_grad_enabled():
            return q, gain
        return derived(self, (q, gain), lambda: q * gain), None

    def depth_weights(self, *sources: torch.Tensor) -> torch.Tensor:
        """alpha [n, *batch, heads]: the weight of each source (for diagnostics); the
        output is sum_i alpha_i v_i with each head's weight over its channel slice."""
        return ops.depth_weights(sources, self._query(sources), self.gain, EPS,
                                 key_norm=self.key_norm is not None, gate=self.gate,
                                 heads=self.heads)

    def input_weights(self, *sources: torch.Tensor) -> list[torch.Tensor]:
        alpha = self.depth_weights(*sources)
        return list(alpha.repeat_interleave(self.d // self.heads, dim=-1))

    def merge(self, phase1, slot: int, partial: torch.Tensor | None,
              norm_weight: torch.Tensor | None = None,
              norm_eps: float | None = None) -> torch.Tensor:
        """Phase 2: this member's slice of its group's phase-1 result merged with its
        pre-update partial (None for the first sublayer of a block). With `norm_eps`, the
        next sublayer's PreNorm (gain `norm_weight`) in the same op: returns RMSNorm(h),
        the sublayer's normalised input, not h."""
        o1, m1, s1 = phase1[:3]
        if len(phase1) > 3 and partial is None and slot == 0:
            y0, gain, eps = phase1[3]  # phase 1 made this PreNorm (TwoPhase.fuse_first_norm)
            if gain is norm_weight and eps == norm_eps:
                return y0
        if unrecorded():
            extra = () if norm_weight is None else (norm_weight,)
            call = self._bound("merge", extra, lambda q, gain, key_norm: ops.bind_phase2(
                q, gain, EPS, norm_weight=norm_weight, norm_eps=norm_eps, key_norm=key_norm,
                keep_h=False, backend=self.backend))
            got = call(o1[slot], m1[slot], s1[slot], partial)
            return got if norm_eps is None else got[1]
        q, gain = self._static()
        args = (o1[slot], m1[slot], s1[slot], partial, q, gain, EPS)
        key_norm = own(self, "key_norm") is not None
        if norm_eps is None:
            return ops.phase2(*args, key_norm=key_norm, backend=self.backend)
        return ops.phase2_norm(*args, norm_weight=norm_weight, norm_eps=norm_eps,
                               key_norm=key_norm, keep_h=False, backend=self.backend)[1]

    def extra_repr(self) -> str:
        return f"d={self.d}, query={self.query}, gate={self.gate}, heads={self.heads}"


class TwoPhase(nn.Module):
    """Phase 1 for a group of static-query softmax `Attend` modules reading the same
    completed sources: all their queries in one batched pass over the completed blocks.

    The members are referenced, not registered, so each pseudo-query and key-norm gain has
    one owner (its aggregation) in `parameters()` and `state_dict()`.
    """

    def __init__(self, members: list[Attend], backend: str = "auto"):
        super().__init__()
        if len({(m.key_norm is None, m.heads) for m in members}) != 1:
            raise ValueError("a two-phase group needs members with one key norm and head count")
        self.__dict__["members"] = tuple(members)  # plain attribute: not a submodule
        self.__dict__["first_norm"] = None
        self.heads = members[0].heads
        self.has_key_norm = members[0].key_norm is not None
        self.backend = backend

    def fuse_first_norm(self, norm: nn.RMSNorm) -> None:
        """The PreNorm of the first member's sublayer, which the lowering fused into that
        member's phase 2 (restopo.fx.lower). That member has no partial to merge, so phase 2
        is its PreNorm alone; without autograd, phase 1's kernel then makes it in the same
        call and hands it on in the state, `(o1, m1, s1, (y0, gain, eps))` (a decoding step
        makes one call less a block). Referenced, not registered: the sublayer owns it."""
        self.__dict__["first_norm"] = norm

    def forward(self, *completed: torch.Tensor, logits=None):
        if logits is None and unrecorded():
            return _per_member(self._bound()(completed))
        queries, gains = self._queries()
        return _per_member(ops.phase1(completed, queries, gains, EPS,
                                      key_norm=self.has_key_norm, heads=self.heads,
                                      backend=self.backend, logits=logits))

    def runs_kernels(self, device, dtype) -> bool:
        """As Attend.runs_kernels: phase 1 is static queries and the softmax gate."""
        return ops.cpu_kernels(self.backend, device, dtype)

    def _bound(self):
        """ops.bind_phase1 for the members' queries, kept while they are unchanged."""
        got = trusted(self, "derived")
        if got is not None:
            return got
        members, norm = self.members, self.first_norm
        if self.has_key_norm:
            params = tuple(p for m in members for p in (own(m, "pseudo_query"),
                                                        own(own(m, "key_norm"), "weight")))
        else:
            params = tuple(own(m, "pseudo_query") for m in members)
        gain = None if norm is None else own(norm, "weight")
        params += () if gain is None else (gain,)
        return derived(self, params, lambda: ops.bind_phase1(
            *self._queries(), EPS, key_norm=self.has_key_norm, heads=self.heads,
            backend=self.backend, norm_weight=gain,
            norm_eps=None if norm is None else float(norm.eps)))

    def _queries(self):
        """(the members' pseudo-queries [S, d], their key-norm gains [S, d] or None)."""
        members = self.members
        queries = torch.stack([m.pseudo_query for m in members])
        gains = torch.stack([m.gain for m in members]) if self.has_key_norm else None
        return queries, gains

    def extra_repr(self) -> str:
        return f"members={len(self.members)}"


def _per_member(state: tuple) -> tuple:
    """Phase 1's (o1, m1, s1), each a tuple of the members' slices. Split once here, so
    autograd gathers each output's gradient in one piece rather than zero-filling all of it
    for every member (the fused backends' o1 is already a tuple; s1 is S Nones for the
    normalised form, see ops.phase1)."""
    if all(type(x) is tuple for x in state):
        return state
    return tuple(x if isinstance(x, tuple) else x.unbind(0) for x in state)


class Sum(nn.Module):
    """Weight one on every source (the standard residual when it reads everything)."""

    def forward(self, *sources: torch.Tensor) -> torch.Tensor:
        out = sources[0]
        for v in sources[1:]:
            out = out + v
        return out

    def input_weights(self, *sources: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones((), dtype=v.dtype, device=v.device) for v in sources]


class Scalars(nn.Module):
    """h = sum_i alpha_i v_i with one learned static scalar a_i per source (`weights`).

    gate "none": DenseFormer, alpha = a with a init 1, so a fresh model is the standard
    residual. gate "softmax": AttnRes with the input-dependent logit w . RMSNorm(v_i)
    replaced by the static a_i (the paper's "static per-source scalars" ablation); a init
    0, so a fresh model takes the plain mean of the sources, like a zero pseudo-query.
    gate "sigmoid": alpha = sigmoid(a), a init 0 (every source at 1/2).
    """

    def __init__(self, n_sources: int, gate: str = "none"):
        super().__init__()
        if gate not in ("none", "softmax", "sigmoid"):
            raise ValueError(f"scalars gate must be none, softmax or sigmoid; got {gate!r}")
        self.gate = gate
        init = torch.ones if gate == "none" else torch.zeros
        self.weights = nn.Parameter(init(n_sources))

    def alpha(self) -> torch.Tensor:
        """The weight of each source, [n_sources]."""
        if self.gate == "softmax":
            return torch.softmax(self.weights, dim=0)
        if self.gate == "sigmoid":
            return torch.sigmoid(self.weights)
        return self.weights

    def forward(self, *sources: torch.Tensor) -> torch.Tensor:
        # A sum of products, not (w * stack(sources)).sum(0): autograd then keeps the sources
        # themselves, each one tensor whatever the number of points that read it, instead of
        # a stacked copy per aggregation point (O(L^2) values in Full-width wiring).
        w = self.alpha().view(-1, *([1] * sources[0].dim()))
        out = w[0] * sources[0]
        for w_i, v in zip(w[1:], sources[1:]):
            out = out + w_i * v
        return out

    def input_weights(self, *sources: torch.Tensor) -> list[torch.Tensor]:
        return list(self.alpha())

    def extra_repr(self) -> str:
        return f"n_sources={self.weights.numel()}, gate={self.gate}"


class ReZero(nn.Module):
    """h_l = h_{l-1} + alpha * v_{l-1}, alpha a learned scalar, init 0."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, h_prev: torch.Tensor, v_prev: torch.Tensor) -> torch.Tensor:
        return h_prev + self.alpha * v_prev

    def input_weights(self, h_prev: torch.Tensor, v_prev: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones_like(self.alpha), self.alpha]


class LayerScale(nn.Module):
    """h_l = h_{l-1} + gamma * v_{l-1}, gamma a learned per-channel vector, init 0.1."""

    def __init__(self, d: int, init: float = 0.1):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, h_prev: torch.Tensor, v_prev: torch.Tensor) -> torch.Tensor:
        return h_prev + self.gamma * v_prev

    def input_weights(self, h_prev: torch.Tensor, v_prev: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones_like(self.gamma), self.gamma]


class Highway(nn.Module):
    """h_l = h_{l-1} + g * (v_{l-1} - h_{l-1}), g = sigmoid(W rmsnorm(h_{l-1}) + b).

    The bias starts at -2 so the gate starts mostly closed (carry-biased): the stream
    passes through and each sublayer's output enters at about 12 %.
    """

    def __init__(self, d: int, bias_init: float = -2.0):
        super().__init__()
        self.d = d
        self.gate = nn.Linear(d, d)
        nn.init.normal_(self.gate.weight, std=0.02)
        nn.init.constant_(self.gate.bias, bias_init)

    def transform_gate(self, h_prev: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(F.rms_norm(h_prev, (self.d,), eps=EPS)))

    def forward(self, h_prev: torch.Tensor, v_prev: torch.Tensor) -> torch.Tensor:
        g = self.transform_gate(h_prev)
        return h_prev + g * (v_prev - h_prev)

    def input_weights(self, h_prev: torch.Tensor, v_prev: torch.Tensor) -> list[torch.Tensor]:
        g = self.transform_gate(h_prev)
        return [1 - g, g]


class StreamStart(nn.Module):
    """The first aggregation of a stream topology: h_1 = v_0 (it owns no weight, since a
    stream update owns the weight of the output it adds)."""

    def forward(self, v0: torch.Tensor) -> torch.Tensor:
        return v0

    def input_weights(self, v0: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones((), dtype=v0.dtype, device=v0.device)]


def make_aggregation(agg: Aggregation, d: int, backend: str = "auto") -> nn.Module:
    """The module for one IR aggregation node (multi-stream ones: restopo.nn.streams)."""
    method = agg.method
    if agg.multi_stream:
        return make_stream_module(method, agg.streams, d, agg.index, agg.is_head,
                                  agg.dynamic, agg.sinkhorn)
    if method == "attend":
        return Attend(d, agg.query, agg.gate, agg.key_norm, agg.heads, backend)
    if method == "sum":
        return Sum()
    if method == "scalars":
        return Scalars(len(agg.sources), agg.gate)
    if method in STREAM_METHODS:
        if agg.index == 1:
            return StreamStart()
        return {"rezero": ReZero, "layerscale": lambda: LayerScale(d),
                "highway": lambda: Highway(d)}[method]()
    raise ValueError(f"unknown aggregation method {method!r}")
