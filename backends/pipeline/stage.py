"""One pipeline chunk as an nn.Module: the model's own sublayer, aggregation, embedding and
head modules for sublayers a..b, run over the IR.

The chunk receives the plan's values for its incoming cut as a flat tuple of [B, T, d]
tensors (chunk 0 receives the token ids), computes its sublayers and the aggregations it
owns, and returns the values the plan sends across its outgoing cut (the last chunk returns
the logits). Values are rebuilt exactly as the lowering (restopo/fx/lower.py) builds them:
block sums and partials are running sums in member order (p_n^2 is the block's first
output, p_n^{j+1} = p_n^j + v, b_n = p_n^{|n|} + v_last), a standard stream is
h_l = h_{l-1} + v_{l-1}, stream updates call their module on (h_{l-1}, v_{l-1}), and every
other aggregation calls its module on its sources in IR order. Two-phase groups are run as
their (mathematically identical) direct aggregations.

With caching, values this rank already holds come from its `RankCache` (see cache.py).
The rotary context depends only on the sequence length, so every chunk rebuilds it from the
shape of what it receives.
"""
from __future__ import annotations

import torch
from torch import nn

from restopo.ir.analyses import aggregations as agg_nodes

from .cache import Boundary, Inject, RankCache
from .plan import EMBEDDING, Plan, Value, _value, stream_fed


class ChunkModule(nn.Module):
    def __init__(self, plan: Plan, g, chunk: int, *, embed, sublayers, aggregations, head,
                 context=None, cached: bool = True, cache: RankCache | None = None,
                 n_microbatches: int = 1):
        super().__init__()
        self.plan, self.g, self.c = plan, g, chunk
        self.info = plan.chunks[chunk]
        self.cached = cached
        self.cache = cache if cache is not None else RankCache()
        self.n_microbatches = n_microbatches
        self.calls = 0
        L = g.graph["sublayers"]
        self.L = L
        self.blocks = g.graph["blocks"]
        self.aggs = {g.nodes[a]["index"]: a for a in agg_nodes(g)}
        # Only this chunk's modules are registered, so parameters() is the chunk's own.
        self.embed = embed if self.info.embedding else None
        self.head = head if self.info.head else None
        self.sublayers = nn.ModuleDict({str(i): sublayers[i - 1] for i in self.info.sublayers})
        self.aggregations = nn.ModuleDict({str(l): aggregations[l - 1]
                                           for l in self.info.aggregations})
        self.__dict__["context"] = context  # buffers only; shared, not owned
        self.first = self.info.sublayers[0]
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
        env = _Env(self, mb)
        if self.info.embedding:
            idx = inputs[0]
            env.have[EMBEDDING] = self.embed(idx)
            batch, T = idx.shape
        else:
            for v, t in zip(self.in_values, inputs):
                env.have[v] = t
            batch, T = inputs[0].shape[:2]
        ref = env.have[EMBEDDING] if EMBEDDING in env.have else inputs[0]
        ctx = ()
        if self.context is not None:
            ctx = tuple(self.context(torch.zeros(batch, T, dtype=torch.long, device=ref.device),
                                     ref))
        env.start()
        if 1 in self.info.aggregations and stream_fed(self.g, self.aggs[1]):
            env.h[1] = env.get(EMBEDDING)
        for i in self.info.sublayers:
            if i not in env.h:
                env.h[i] = self._aggregate(env, i)
            v = self.sublayers[str(i)](env.h[i], *ctx)
            env.produced(i, v)
            nxt = self.aggs[i + 1]
            if stream_fed(self.g, nxt) and (i + 1) in self.info.aggregations:
                env.h[i + 1] = self._stream_update(env, i + 1, v)
        if self.info.head:
            l = self.L + 1
            if l not in env.h:
                env.h[l] = self._aggregate(env, l)
            return self.head(env.h[l]).float()
        outs = [Boundary.apply(env.value(v)) for v in self.out_values]
        if self.keep:
            # Keep one copy of each value later chunks of this rank read, and route the
            # gradients they accumulate back through this chunk (see cache.py).
            keep = [v for v in self.keep if v not in env.from_cache]
            tensors = [env.value(v) for v in keep]
            leaves = [self.cache.put(mb, v, t) for v, t in zip(keep, tensors)]
            if leaves:
                outs[0] = Inject.apply(outs[0], leaves, *tensors)
        return tuple(outs)

    def _aggregate(self, env: "_Env", l: int) -> torch.Tensor:
        a = self.aggs[l]
        at = self.g.nodes[a]
        module = self.aggregations[str(l)]
        srcs = [env.source(s) for s in at["sources"]]
        if at["method"] == "sum":
            out = srcs[0]
            for t in srcs[1:]:
                out = out + t
            return out
        return module(*srcs)

    def _stream_update(self, env: "_Env", l: int, v_prev: torch.Tensor) -> torch.Tensor:
        at = self.g.nodes[self.aggs[l]]
        if at["method"] == "sum":
            return env.h[l - 1] + v_prev
        return self.aggregations[str(l)](env.h[l - 1], v_prev)


class _Env:
    """The values one forward of a chunk can see: received, cached and computed."""

    def __init__(self, chunk: ChunkModule, mb: int):
        self.chunk, self.mb = chunk, mb
        self.have: dict[Value, torch.Tensor] = {}
        self.sums: dict[tuple[int, int], torch.Tensor] = {}   # (block n, members m) -> sum
        self.outputs: dict[int, torch.Tensor] = {}            # sublayer i -> v_i
        self.h: dict[int, torch.Tensor] = {}                  # aggregation l -> h_l
        self.from_cache: set[Value] = set()                   # held since an earlier chunk

    def start(self) -> None:
        for v, t in list(self.have.items()):
            if v.kind == "block":
                self.sums[(v.index, len(self.chunk.blocks[v.index - 1]))] = t
            elif v.kind == "partial":
                self.sums[(v.index, v.count)] = t
            elif v.kind == "stream":
                self.h[self.chunk.first] = t

    def get(self, v: Value) -> torch.Tensor:
        if v not in self.have:
            if not self.chunk.cached:
                raise RuntimeError(f"chunk {self.chunk.c} needs {v} but did not receive it")
            self.have[v] = self.chunk.cache.get(self.mb, v)
            self.from_cache.add(v)
            if v.kind == "block":
                self.sums[(v.index, len(self.chunk.blocks[v.index - 1]))] = self.have[v]
        return self.have[v]

    def produced(self, i: int, v: torch.Tensor) -> None:
        self.outputs[i] = v
        n = self.chunk.g.nodes[f"sublayer{i}"]["block"]
        members = self.chunk.blocks[n - 1]
        j = members.index(i) + 1
        if j == 1:
            self.sums[(n, 1)] = v
        elif (n, j - 1) in self.sums:
            self.sums[(n, j)] = self.sums[(n, j - 1)] + v

    def block_sum(self, n: int, m: int) -> torch.Tensor:
        if (n, m) not in self.sums:
            members = self.chunk.blocks[n - 1]
            v = _value("block", n) if m == len(members) else _value("partial", n, m)
            self.get(v)  # a completed block may be cached; a partial never is
        return self.sums[(n, m)]

    def source(self, src: str) -> torch.Tensor:
        """The tensor of IR source `src`."""
        node = self.chunk.g.nodes[src]
        kind = node["kind"]
        if kind == "embedding":
            return self.get(EMBEDDING)
        if kind == "sublayer":
            i = node["index"]
            if i in self.outputs:
                return self.outputs[i]
            n = node["block"]
            if len(self.chunk.blocks[n - 1]) == 1:
                return self.block_sum(n, 1)
            return self.get(_value("sublayer", i))
        if kind == "block":
            return self.block_sum(node["index"], len(node["members"]))
        return self.block_sum(node["block"], node["j"] - 1)  # partial n.j

    def value(self, v: Value) -> torch.Tensor:
        """The tensor of a plan value at this chunk's outgoing cut."""
        if v.kind == "embedding":
            return self.get(EMBEDDING)
        if v.kind == "stream":
            return self.h[self.chunk.info.sublayers[-1] + 1]
        if v.kind == "sublayer":
            return self.outputs[v.index] if v.index in self.outputs else self.get(v)
        if v.kind == "block":
            return self.block_sum(v.index, len(self.chunk.blocks[v.index - 1]))
        return self.block_sum(v.index, v.count)


def build_chunks(plan: Plan, g, parts, aggregations, rank: int, *, cached: bool = True,
                 n_microbatches: int = 1) -> list[ChunkModule]:
    """The chunk modules of `rank` (chunks rank, rank + P, ...), sharing one cache."""
    cache = RankCache()
    return [ChunkModule(plan, g, c.index, embed=parts.embed, sublayers=parts.sublayers,
                        aggregations=aggregations, head=parts.head, context=parts.context,
                        cached=cached, cache=cache, n_microbatches=n_microbatches)
            for c in plan.chunks if c.rank == rank]
