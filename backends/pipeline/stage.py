"""One pipeline chunk as an nn.Module: the model's own sublayer, aggregation, embedding and
head modules for sublayers a..b, run by the one walk over the IR (restopo.ir.walk).

The chunk receives the plan's values for its incoming cut as a flat tuple of [B, T, d]
tensors (chunk 0 receives the token ids), walks its span of sublayers with the aggregations
it owns, and returns the values the plan sends across its outgoing cut (the last chunk
returns the logits). The walk computes everything exactly as the lowered model does (same
running sums, same stream rule, and the two-phase plan for groups whose members all sit in
this chunk); values made before the span come from `_ChunkRun.provide`: received from the
previous chunk, or, with caching, held by this rank's `RankCache` (see cache.py).
The rotary context depends only on the sequence length, so every chunk rebuilds it from the
shape of what it receives. With a compute dtype other than float32 (bf16 on CUDA) the walk
runs under autocast and the values leave the chunk in that dtype.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from restopo.ir import BlockSum, Embedding, Partial, Streams, Sublayer, two_phase_plan
from restopo.ir.walk import walk
from restopo.nn.aggregate import TwoPhase
from restopo.nn.run import EagerRun

from .cache import Boundary, Inject, RankCache
from .plan import EMBEDDING, STREAM, Plan, Value, _value


class ChunkModule(nn.Module):
    def __init__(self, plan: Plan, g, chunk: int, *, embed, sublayers, aggregations, head,
                 context=None, cached: bool = True, cache: RankCache | None = None,
                 n_microbatches: int = 1, dtype: torch.dtype = torch.float32,
                 device_type: str = "cpu"):
        super().__init__()
        self.dtype, self.device_type = dtype, device_type
        self.plan, self.g, self.c = plan, g, chunk
        self.info = plan.chunks[chunk]
        self.cached = cached
        self.cache = cache if cache is not None else RankCache()
        self.n_microbatches = n_microbatches
        self.calls = 0
        # Only this chunk's modules are registered, so parameters() is the chunk's own.
        self.embed = embed if self.info.embedding else None
        self.head = head if self.info.head else None
        self.sublayers = nn.ModuleDict({str(i): sublayers[i - 1] for i in self.info.sublayers})
        self.aggregations = nn.ModuleDict({str(l): aggregations[l - 1]
                                           for l in self.info.aggregations})
        self.__dict__["context"] = context  # buffers only; shared, not owned
        span = self.info.sublayers
        self.span = (span[0], span[-1])
        # Two-phase groups among the aggregations this chunk owns (phase 1 owns no weights).
        self.groups = two_phase_plan(g, within=set(self.info.aggregations))
        self.__dict__["phases"] = tuple(
            TwoPhase([aggregations[g.node(m).index - 1] for m in grp.members],
                     aggregations[g.node(grp.members[0]).index - 1].backend)
            for grp in self.groups)
        self.in_values = plan.inputs(chunk, cached)
        self.out_values = plan.outputs(chunk, cached)
        # Cacheable values needed after this chunk: kept for this rank's later chunks.
        self.keep = tuple(v for v in (plan.hops[chunk].naive if chunk < plan.n_chunks - 1 else ())
                          if not v.transient) if cached else ()

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs):
        # PipelineStage does not tell the module which microbatch it runs; every schedule
        # runs a stage's forwards in microbatch order, once each per step, and the runtime
        # resets `calls` before each step, so the count names the microbatch (the cache key).
        mb = self.calls % self.n_microbatches
        self.calls += 1
        received = {} if self.info.embedding else dict(zip(self.in_values, inputs))
        run = _ChunkRun(self, mb, received, idx=inputs[0] if self.info.embedding else None)
        with self._autocast():
            if not self.info.embedding:
                run.set_context(inputs[0])
            w = walk(self.g, run, self.groups, span=self.span)
        if self.info.head:
            return w.output.float()
        outs = [Boundary.apply(w.value(self.node_of(v)), self.dtype) for v in self.out_values]
        if self.keep:
            # Keep one copy of each value later chunks of this rank read, and route the
            # gradients they accumulate back through this chunk (see cache.py).
            keep = [v for v in self.keep if v not in run.from_cache]
            tensors = [w.value(self.node_of(v)) for v in keep]
            leaves = [self.cache.put(mb, v, t) for v, t in zip(keep, tensors)]
            if leaves:
                outs[0] = Inject.apply(outs[0], leaves, *tensors)
        return tuple(outs)

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def node_of(self, v: Value) -> str:
        """The IR node whose tensor carries plan value `v` at this chunk's outgoing cut."""
        if v.kind == "embedding":
            return Embedding.id
        if v.kind == "stream":
            return f"agg{self.span[1] + 1}"
        if v.kind == "streams":
            return f"streams{self.span[1] + 1}"
        if v.kind == "sublayer":
            return f"sublayer{v.index}"
        members = self.g.blocks[v.index - 1]
        if v.kind == "block":
            return f"sublayer{members[0]}" if len(members) == 1 else f"block{v.index}"
        return f"partial{v.index}.{v.count + 1}"  # partial n[m]: the first m members


class _ChunkRun(EagerRun):
    """The eager walk of one chunk: values from before the span are received or cached."""

    def __init__(self, chunk: ChunkModule, mb: int, received: dict, idx):
        super().__init__(sublayers=_ints(chunk.sublayers), aggregations=_ints(chunk.aggregations),
                         embed=chunk.embed, head=chunk.head, idx=idx, phases=chunk.phases)
        self.chunk, self.mb, self.received = chunk, mb, received
        self.from_cache: set[Value] = set()  # held since an earlier chunk of this rank

    def set_context(self, ref: torch.Tensor) -> None:
        """The sublayers' context (rotary tables) for the batch and length of `ref`, in its
        dtype: the lowered model computes it from (idx, v_0)."""
        context = self.chunk.context
        if context is not None:
            batch, T = ref.shape[:2]
            if ref.dtype in (torch.bfloat16, torch.float16):
                ref = ref.float()  # as the whole model, which makes it from v_0 (float32)
            self.context = tuple(context(
                torch.zeros(batch, T, dtype=torch.long, device=ref.device), ref))

    def embedding(self) -> torch.Tensor:
        v0 = super().embedding()
        self.set_context(v0)
        return v0

    def provide(self, node):
        v = self._carrier(node)
        return None if v is None else self.get(v)

    def _carrier(self, node) -> Value | None:
        """The plan value that carries `node` into this chunk, or None when the node is
        (also partly) made inside the span and must be computed."""
        first = self.chunk.span[0]
        blocks = self.chunk.g.blocks
        if isinstance(node, Embedding):
            return EMBEDDING
        if isinstance(node, Sublayer):
            if node.index >= first:
                return None
            if len(blocks[node.block - 1]) == 1:
                return _value("block", node.block)
            return _value("sublayer", node.index)
        if isinstance(node, (BlockSum, Partial)) and node.members[-1] < first:
            if isinstance(node, BlockSum):
                return _value("block", node.index)
            return _value("partial", node.block, len(node.members))
        if node.id == f"agg{first}":  # the running stream h_first
            return STREAM
        if isinstance(node, Streams) and node.index == first > 1:  # the n streams X_first
            return _value("streams", count=node.n)
        return None

    def get(self, v: Value) -> torch.Tensor:
        if v in self.received:
            return self.received[v]
        chunk = self.chunk
        if not chunk.cached:
            raise RuntimeError(f"chunk {chunk.c} needs {v} but did not receive it")
        t = self.received[v] = chunk.cache.get(self.mb, v)
        self.from_cache.add(v)
        return t


def _ints(modules: nn.ModuleDict) -> dict[int, nn.Module]:
    return {int(k): m for k, m in modules.items()}


def build_chunks(plan: Plan, g, parts, aggregations, rank: int, *, cached: bool = True,
                 n_microbatches: int = 1, dtype: torch.dtype = torch.float32,
                 device_type: str = "cpu") -> list[ChunkModule]:
    """The chunk modules of `rank` (chunks rank, rank + P, ...), sharing one cache."""
    cache = RankCache()
    return [ChunkModule(plan, g, c.index, embed=parts.embed, sublayers=parts.sublayers,
                        aggregations=aggregations, head=parts.head, context=parts.context,
                        cached=cached, cache=cache, n_microbatches=n_microbatches,
                        dtype=dtype, device_type=device_type)
            for c in plan.chunks if c.rank == rank]


def chunk_units(plan: Plan, rank: int) -> list[str]:
    """The model's units (restopo.nn.init names) that the chunks of `rank` hold."""
    units = []
    for c in plan.chunks:
        if c.rank != rank:
            continue
        units += ["embed"] if c.embedding else []
        units += [f"sublayers.{i - 1}" for i in c.sublayers]
        units += [f"aggregations.{l - 1}" for l in c.aggregations]
        units += ["head"] if c.head else []
    return units
