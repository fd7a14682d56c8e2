"""The IR's node types: one frozen dataclass per kind of per-token value (no torch).

Every node has an `id` (the name people see in `restopo inspect`, `restopo graph` and the
generated `model.code`) and `produced`: the sublayer index after which the value exists
(0: before the first sublayer). Sublayers are numbered 1..L, the embedding is source 0 and
the head is aggregation point L + 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from ..topology import MULTI_STREAM_METHODS


@dataclass(frozen=True)
class Embedding:
    """v_0 = b_0, the token embedding (always a source of its own)."""

    id: ClassVar[str] = "embedding"
    produced: ClassVar[int] = 0


@dataclass(frozen=True)
class Sublayer:
    """v_i = f_i(h_i), the raw output of sublayer i (attn | mlp) of block `block`."""

    index: int
    op: str
    block: int

    @property
    def id(self) -> str:
        return f"sublayer{self.index}"

    @property
    def produced(self) -> int:
        return self.index


@dataclass(frozen=True)
class BlockSum:
    """b_n, the sum of block n's outputs. Only blocks of two or more sublayers have one: a
    one-sublayer block *is* that sublayer's output (so Block AttnRes with N = L is Full)."""

    index: int
    members: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"block{self.index}"

    @property
    def produced(self) -> int:
        return self.members[-1]


@dataclass(frozen=True)
class Partial:
    """p_n^j, the sum of the first j - 1 outputs of block n (j >= 2): `members`."""

    block: int
    j: int
    members: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"partial{self.block}.{self.j}"

    @property
    def produced(self) -> int:
        return self.members[-1]


@dataclass(frozen=True)
class Streams:
    """X_l, the n residual streams (n d-vectors per token) of a multi-stream topology before
    sublayer l (l = L + 1: before the head). X_1 is n copies of the embedding; X_{l+1} =
    R_l X_l + post_l (x) v_l, with R_l and post_l made by aggregation l from X_l."""

    index: int
    n: int

    @property
    def id(self) -> str:
        return f"streams{self.index}"

    @property
    def produced(self) -> int:
        return self.index - 1


@dataclass(frozen=True)
class Aggregation:
    """h_l, the input of sublayer l (or, at l = L + 1, of the head), from `sources` (node
    ids, in order) by `method` (see restopo.topology.METHODS).

    block, j: the block the point sits in and its position there (the head: N + 1, 0).
    The options are the rule's: query, gate and key_norm and heads (attend), gate (scalars),
    window (the sliding-window source it read, if any), streams, dynamic and sinkhorn
    (multi-stream methods: the point reads its one source, Streams X_l, into h_l; the
    head's sums the streams).
    """

    index: int
    before: str            # attn | mlp | head
    method: str
    sources: tuple[str, ...]
    block: int
    j: int
    query: str = "static"
    gate: str = "softmax"
    key_norm: str = "rms"
    heads: int = 1
    window: int | None = None
    streams: int = 1
    dynamic: bool = False
    sinkhorn: int | None = None

    @property
    def id(self) -> str:
        return f"agg{self.index}"

    @property
    def produced(self) -> int:
        return self.index - 1

    @property
    def is_head(self) -> bool:
        return self.before == "head"

    @property
    def multi_stream(self) -> bool:
        return self.method in MULTI_STREAM_METHODS


@dataclass(frozen=True)
class Head:
    """The final norm and LM head, reading h_{L+1}."""

    index: int
    id: ClassVar[str] = "head"

    @property
    def produced(self) -> int:
        return self.index


Node = Union[Embedding, Sublayer, BlockSum, Partial, Streams, Aggregation, Head]
Value = Union[Embedding, Sublayer, BlockSum, Partial, Streams]  # what an aggregation may read
