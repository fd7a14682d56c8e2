"""The pipeline plan: pure functions over the topology IR (no torch, no processes).

The L sublayers are cut into C = P * V contiguous chunks balanced by cost; chunk c runs on
rank c mod P (virtual stage c // P). Chunk 0 also holds the embedding, the last chunk the
head aggregation and the head.

What crosses a chunk boundary (the *cut* after sublayer s, the last one of chunk c) is read
off the IR's data flow: every value produced at or before the cut that an aggregation owned
by a later chunk reads. Values are named by what they are, per token, each one d-vector:

  embedding     b_0 = v_0
  block n       a completed block representation b_n (for one-sublayer blocks, as in Full
                AttnRes, that sublayer's output)
  sublayer i    one sublayer output read on its own (window, DenseFormer scalars)
  partial n[m]  the running sum of the first m outputs of block n, for a block that is open
                across the cut (its first m members before the cut, the rest after)
  stream        the running hidden state h_{s+1} of a single-stream topology (the standard
                residual, ReZero, LayerScale, Highway)
  streams       the n streams X_{s+1} of a multi-stream topology (Hyper-Connections, mHC):
                one value of n d-vectors (`size` n), sent as one [b, T, n, d] tensor

`partial`, `stream` and `streams` are the *hidden partial*: transient, recomputed at every
cut, sent at every hop (the n streams change at every sublayer: nothing to cache). When a cut falls exactly on a block boundary the running sum of the block that
just ended *is* that block's representation b_n; it is sent once, counted as a block, and no
separate partial crosses (nothing is open). So when every chunk completes exactly N_p whole
blocks, the transfers per token are, in d-vectors:

  naive   blocks C(C-1)/2 N_p          + embedding C-1 + hidden partial at every open cut
  cached  blocks P(P-1)/2 N_p + (V-1) P(P-1) N_p + embedding P-1 + the same hidden partials

The hidden-partial term is C-1 when every cut falls inside a block (chunks offset from the
blocks, each still completing N_p of them) and 0 when every cut is on a block boundary.

Naive: every hop carries everything needed later. Cached: each rank keeps one copy of every
value it received or produced, shared by its virtual stages, and a hop sends only what the
receiving rank has not seen (plus the hidden partial). Gradients mirror this in backward,
so the backward bytes equal the forward bytes.

Stage ownership of aggregations: an attending (or any direct) aggregation before sublayer l
belongs to the chunk holding sublayer l; a stream update h_l = h_{l-1} (+) v_{l-1} belongs to
the chunk holding sublayer l-1, so that a single running value (one vector) crosses each cut
of a standard residual. The head aggregation belongs to the last chunk either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from restopo.ir import IR, BlockSum, Embedding, Streams, Sublayer, stream_fed
from restopo.nn.flops import head_flops, point_flops, running_sum_flops, sublayer_flops

TRANSIENT = ("partial", "stream", "streams")


class PlanError(ValueError):
    """A pipeline that cannot be planned (message says what to change)."""


@dataclass(frozen=True, order=True)
class Value:
    """One d-vector per token that may cross a cut (see the module docstring)."""

    order: tuple = field(repr=False, compare=True)
    kind: str = field(compare=False)
    index: int = field(default=0, compare=False)
    count: int = field(default=0, compare=False)

    @property
    def name(self) -> str:
        if self.kind in ("embedding", "stream"):
            return self.kind
        if self.kind == "partial":
            return f"partial{self.index}[{self.count}]"
        if self.kind == "streams":
            return f"streams[{self.count}]"
        return f"{self.kind}{self.index}"

    @property
    def size(self) -> int:
        """d-vectors per token: n for the streams, else 1."""
        return self.count if self.kind == "streams" else 1

    def shape(self, batch: int, T: int, d: int) -> tuple[int, ...]:
        """The tensor that carries this value across a cut."""
        return (batch, T, self.count, d) if self.kind == "streams" else (batch, T, d)

    @property
    def transient(self) -> bool:
        return self.kind in TRANSIENT

    def __str__(self) -> str:
        return self.name


def _value(kind: str, index: int = 0, count: int = 0) -> Value:
    # Order: the embedding, then blocks and sublayer outputs as produced, then the hidden
    # partial last (it is the one a receiving chunk reads first).
    rank = {"embedding": 0, "block": 1, "sublayer": 1, "partial": 2, "stream": 3,
            "streams": 3}[kind]
    return Value((rank, index, count, kind), kind, index, count)


EMBEDDING = _value("embedding")
STREAM = _value("stream")


@dataclass(frozen=True)
class Chunk:
    index: int
    rank: int
    virtual: int
    sublayers: tuple[int, ...]
    aggregations: tuple[int, ...]      # aggregation indices l this chunk computes (L+1: head)
    blocks_completed: tuple[int, ...]  # block numbers n whose last sublayer is here
    cost: float
    embedding: bool
    head: bool


@dataclass(frozen=True)
class Hop:
    """The transition from chunk `src` to chunk `src + 1`."""

    src: int
    src_rank: int
    dst_rank: int
    naive: tuple[Value, ...]
    cached: tuple[Value, ...]


@dataclass(frozen=True)
class Plan:
    stages: int           # P
    virtual: int          # V
    width: int | None     # d
    dtype_bytes: int
    topology: str
    n_blocks: int
    chunks: tuple[Chunk, ...]
    hops: tuple[Hop, ...]

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def hop_values(self, hop: Hop, cached: bool) -> tuple[Value, ...]:
        return hop.cached if cached else hop.naive

    def inputs(self, chunk: int, cached: bool) -> tuple[Value, ...]:
        """The values chunk `chunk` receives from the previous one, in send order."""
        return () if chunk == 0 else self.hop_values(self.hops[chunk - 1], cached)

    def outputs(self, chunk: int, cached: bool) -> tuple[Value, ...]:
        return () if chunk == self.n_chunks - 1 else self.hop_values(self.hops[chunk], cached)

    def vectors(self, cached: bool, kind: str | None = None) -> int:
        """d-vectors per token sent over all hops (of one kind: embedding|block|sublayer|
        hidden, where hidden is partial + stream)."""
        kinds = TRANSIENT if kind == "hidden" else (kind,)
        return sum(v.size for h in self.hops for v in self.hop_values(h, cached)
                   if kind is None or v.kind in kinds)

    def bytes_per_token(self, cached: bool) -> int | None:
        if self.width is None:
            return None
        return self.vectors(cached) * self.width * self.dtype_bytes

    @property
    def blocks_per_chunk(self) -> tuple[int, ...]:
        return tuple(len(c.blocks_completed) for c in self.chunks)

    @property
    def uniform_np(self) -> int | None:
        """N_p when every chunk completes the same number of blocks, else None."""
        counts = set(self.blocks_per_chunk)
        return counts.pop() if len(counts) == 1 else None

    @property
    def paper_bound_blocks(self) -> float:
        """The paper's bound on cached block transfers per token, P(P-1)/2 N_p +
        (V-1) P^2 N_p, with N_p = N / C (exact when every chunk completes N_p blocks)."""
        P, V = self.stages, self.virtual
        n_p = self.n_blocks / self.n_chunks
        return P * (P - 1) / 2 * n_p + (V - 1) * P * P * n_p


def parse_pv(text: str) -> tuple[int, int]:
    """'4x2' -> (4, 2); '4' -> (4, 1). Raises PlanError with what to write instead."""
    parts = text.lower().replace(" ", "").split("x")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        p, v = int(parts[0]), int(parts[1]) if len(parts) == 2 else 1
    except ValueError:
        raise PlanError(f"--pipeline takes STAGESxVIRTUAL, e.g. 4x2 (4 ranks, 2 chunks "
                        f"each); got {text!r}") from None
    if p < 1 or v < 1:
        raise PlanError(f"--pipeline stages and virtual stages must be at least 1; got {text!r}")
    if p < 2:  # what train refuses is not planned either (inspect planned 1x2)
        raise PlanError(f"a pipeline needs at least 2 stages; got {p}x{v}")
    return p, v


def sublayer_costs(kinds, width: int | None = None, context: int | None = None,
                   mlp: str = "swiglu", mlp_ratio: float = 4.0) -> dict[str, float]:
    """Per-token forward FLOPs of one sublayer of each kind, as `restopo inspect` counts them
    (restopo.nn.flops: the MLP at the hidden width the model builds). Without a width every
    sublayer weighs 1."""
    if width is None:
        return {k: 1.0 for k in set(kinds)}
    return {k: sublayer_flops(k, width, context or 0, mlp, mlp_ratio) for k in set(kinds)}


def model_costs(model, g: IR) -> dict:
    """make_plan's costs for a spec's ModelSpec, in the forward FLOPs per token `restopo
    inspect` reports: each sublayer's, the head's (with the head aggregation), and the
    topology's own work by the sublayer whose chunk does it (`topology_costs`)."""
    head = head_flops(model) + point_flops(g, g.aggregation(g.n_sublayers + 1), model.width)
    return dict(costs=sublayer_costs(model.kinds, model.width, model.context, model.mlp,
                                     float(model.mlp_ratio)),
                head_cost=head, extra=topology_costs(g, model.width))


def topology_costs(g: IR, d: int) -> dict[int, float]:
    """Sublayer i -> the topology's arithmetic per token that its chunk does: the aggregation
    point before it (after it, for a stream update: make_plan's owners) and the add of its
    output into its block's running sum. With Full AttnRes a late chunk's points read many
    more sources than an early one's (at d = 64, L = 32, a tenth of the forward)."""
    out = dict(running_sum_flops(g, d))
    for a in g.aggregations():
        if a.index <= g.n_sublayers:
            i = max(a.index - 1, 1) if stream_fed(g, a) else a.index
            out[i] = out.get(i, 0) + point_flops(g, a, d)
    return out


def balance(weights: list[float], n_chunks: int, aligned: set[int] | None = None) -> list[int]:
    """Contiguous split of `weights` into `n_chunks` non-empty runs minimising the largest
    run's total; among those, the fewest cuts off `aligned` (cut positions, counted in items
    before the cut, that are preferred: block boundaries). Returns the cut positions."""
    n = len(weights)
    if not 1 <= n_chunks <= n:
        raise PlanError(f"cannot split {n} sublayers into {n_chunks} chunks: use at most {n} "
                        f"chunks (stages x virtual), each chunk needs at least one sublayer")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible largest run for the first i items in k runs.
    best = [[inf] * (n + 1) for _ in range(n_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, n_chunks + 1):
        for i in range(k, n + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    limit = best[n_chunks][n] * (1 + 1e-9)
    aligned = aligned or set()
    # Second pass: fewest misaligned cuts with every run within the optimum.
    miss = [[(inf, ())] * (n + 1) for _ in range(n_chunks + 1)]
    miss[0][0] = (0, ())
    for k in range(1, n_chunks + 1):
        for i in range(k, n + 1):
            cands = []
            for j in range(k - 1, i):
                if miss[k - 1][j][0] == inf or prefix[i] - prefix[j] > limit:
                    continue
                extra = 0 if (j == 0 or j in aligned) else 1
                cands.append((miss[k - 1][j][0] + extra, miss[k - 1][j][1] + ((j,) if j else ())))
            if cands:
                miss[k][i] = min(cands)
    return list(miss[n_chunks][n][1])


def make_plan(g: IR, stages: int, virtual: int = 1, *, costs: dict | None = None,
              head_cost: float = 0.0, extra: dict[int, float] | None = None,
              cuts: list[int] | None = None, dtype_bytes: int = 4) -> Plan:
    """Plan a pipeline of `stages` ranks x `virtual` chunks per rank over the IR `g`.

    `costs` weighs each sublayer kind (default: `sublayer_costs` from the IR's width, or 1
    each); `extra` adds to sublayer i's weight (the topology's work, see model_costs);
    `head_cost` is added to the last chunk. `cuts` fixes the chunk boundaries by hand
    (sublayer indices s: a chunk ends after sublayer s), overriding the balancing.
    """
    if stages < 1 or virtual < 1:
        raise PlanError(f"stages and virtual stages must be at least 1; got {stages}x{virtual}")
    L, kinds = g.n_sublayers, g.kinds
    C = stages * virtual
    if C > L:
        raise PlanError(f"{stages}x{virtual} pipeline needs {C} chunks but the model has only "
                        f"{L} sublayers; use fewer stages or virtual stages (at most {L} chunks)")
    costs = costs or sublayer_costs(kinds, g.width)
    extra = extra or {}
    weights = [float(costs[k] + extra.get(i, 0)) for i, k in enumerate(kinds, 1)]
    blocks = g.blocks
    block_ends = {b[-1] for b in blocks}
    if cuts is None:
        cuts = balance(weights, C, aligned=block_ends - {L})
    cuts = sorted(cuts)
    if len(cuts) != C - 1 or len(set(cuts)) != len(cuts) or (cuts and not 1 <= cuts[0] <= cuts[-1] < L):
        raise PlanError(f"cuts must be {C - 1} distinct sublayer indices in 1..{L - 1}; got {cuts}")
    bounds = [0] + cuts + [L]
    spans = [tuple(range(bounds[c] + 1, bounds[c + 1] + 1)) for c in range(C)]
    chunk_of = {i: c for c, span in enumerate(spans) for i in span}

    owner = {}
    for a in g.aggregations():
        l = a.index
        if l == L + 1:
            owner[l] = C - 1
        elif stream_fed(g, a):
            owner[l] = 0 if l == 1 else chunk_of[l - 1]
        else:
            owner[l] = chunk_of[l]

    chunks = []
    for c, span in enumerate(spans):
        done = tuple(n for n, b in enumerate(blocks, 1) if b[-1] in span)
        chunks.append(Chunk(c, c % stages, c // stages, span,
                            tuple(sorted(l for l, o in owner.items() if o == c)), done,
                            sum(weights[i - 1] for i in span) + (head_cost if c == C - 1 else 0),
                            c == 0, c == C - 1))

    hops, seen = [], {r: set() for r in range(stages)}
    seen[0].add(EMBEDDING)
    for c in range(C - 1):
        seen[c % stages].update(_produced(g, spans[c], blocks))
        need = needed_after(g, bounds[c + 1], owner, c)
        dst = (c + 1) % stages
        if dst == c % stages:
            sent = ()
        else:
            sent = tuple(v for v in need if v.transient or v not in seen[dst])
        seen[dst].update(v for v in sent if not v.transient)
        hops.append(Hop(c, c % stages, dst, need, sent))
    return Plan(stages, virtual, g.width, dtype_bytes, g.topology,
                len(blocks), tuple(chunks), tuple(hops))


def _produced(g: IR, span: tuple[int, ...], blocks) -> set[Value]:
    """The cacheable values a chunk produces: its completed blocks and sublayer outputs."""
    out = set()
    for n, b in enumerate(blocks, 1):
        if b[-1] in span:
            out.add(_value("block", n))
    for i in span:
        if len(blocks[g.sublayer(i).block - 1]) > 1:
            out.add(_value("sublayer", i))
    return out


def source_value(g: IR, src: str, s: int) -> Value | None:
    """The value that carries IR source `src` across the cut after sublayer s (None when
    `src` is produced entirely after the cut)."""
    node = g.node(src)
    if isinstance(node, Embedding):
        return EMBEDDING
    if isinstance(node, Streams):  # X_l is made after sublayer l-1: only X_{s+1} crosses
        return _value("streams", count=node.n) if node.index == s + 1 else None
    if isinstance(node, Sublayer):
        if node.index > s:
            return None
        n = node.block
        return _value("block", n) if len(g.blocks[n - 1]) == 1 else _value("sublayer", node.index)
    # a block sum, or partial n.j: the sum of the first j-1 members of block n
    n = node.index if isinstance(node, BlockSum) else node.block
    before = [i for i in node.members if i <= s]
    if not before:
        return None
    if isinstance(node, BlockSum) and len(before) == len(node.members):
        return _value("block", n)
    return _value("partial", n, len(before))


def needed_after(g: IR, s: int, owner: dict[int, int], c: int) -> tuple[Value, ...]:
    """Every value produced at or before the cut after sublayer s (chunk c's end) that a
    later chunk reads, in a fixed order.

    A stream update reads only h_{l-1} and v_{l-1}; the one produced before the cut is the
    running value h_{s+1}, which chunk c computes (it owns the update after sublayer s) and
    sublayer s+1 reads: that is the `stream` value.
    """
    need = set()
    for a in g.aggregations():
        if owner[a.index] <= c or stream_fed(g, a):
            continue
        for src in a.sources:
            v = source_value(g, src, s)
            if v is not None:
                need.add(v)
    if stream_fed(g, g.aggregation(s + 1)):
        need.add(STREAM)
    return tuple(sorted(need))
