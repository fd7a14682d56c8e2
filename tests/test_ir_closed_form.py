"""The IR built through the language against closed forms written from attnres.md.

For Block AttnRes the j-th sublayer of block n reads [b_0, b_1 .. b_{n-1}] and, for j >= 2,
the partial p_n^j; the head reads [b_0, b_1 .. b_N]. A block of one sublayer is shown as that
sublayer. `blocks: N` groups the transformer layers as evenly as possible, larger groups
first; N = L gives one block per sublayer (Full AttnRes). Nothing here calls the
partitioning code of restopo.topology: the enumeration is independent.
"""
from __future__ import annotations

import pytest

from restopo.ir import live_values_per_token, summary
from restopo.spec import parse_spec

DEPTHS = range(1, 33)


def spec_text(depth: int, residual: str) -> str:
    return (f"model {{ vocab: 256; width: 16; depth: {depth}; heads: 2; context: 8 }}\n"
            f"residual {residual}\n")


def block_sizes_by_count(depth: int, n: int) -> list[int]:
    """Sublayers per block: N groups of whole layers (larger first), or L blocks of one."""
    if n == 2 * depth:
        return [1] * n
    q, r = divmod(depth, n)
    return [2 * (q + 1)] * r + [2 * q] * (n - r)


def block_sizes_by_size(depth: int, s: int) -> list[int]:
    L = 2 * depth
    return [min(s, L - start) for start in range(0, L, s)]


def expected_sources(sizes: list[int]) -> list[list[str]]:
    """Sources of aggregations 1..L+1 for blocks of the given sizes (closed form)."""
    names, first = [], 1
    for n, size in enumerate(sizes, start=1):
        names.append(f"sublayer{first}" if size == 1 else f"block{n}")
        first += size
    out = []
    for n, size in enumerate(sizes, start=1):
        for j in range(1, size + 1):
            out.append(["embedding"] + names[: n - 1] + (["partial"] if j >= 2 else []))
    out.append(["embedding"] + names)
    return out


def check(depth: int, residual: str, sizes: list[int]):
    spec = parse_spec(spec_text(depth, residual))
    g = spec.ir()
    s = summary(g)
    assert s["sublayers"] == 2 * depth
    assert s["block_sizes"] == sizes
    assert [a["sources"] for a in s["aggregations"]] == expected_sources(sizes)
    assert [a["before"] for a in s["aggregations"]] == ["attn", "mlp"] * depth + ["head"]
    assert s["live_values_per_token"] == len(sizes) + 1
    return g


@pytest.mark.parametrize("depth", DEPTHS)
def test_block_attnres_every_allowed_count(depth):
    allowed = list(range(1, depth + 1)) + ([2 * depth] if 2 * depth > depth else [])
    for n in allowed:
        check(depth, f"block_attnres(blocks: {n})", block_sizes_by_count(depth, n))


@pytest.mark.parametrize("depth", DEPTHS)
def test_block_attnres_block_sizes(depth):
    L = 2 * depth
    for s in sorted({2, 4, 6, 8, 16, L} & set(range(2, L + 1, 2))):
        check(depth, f"block_attnres(block_size: {s})", block_sizes_by_size(depth, s))


@pytest.mark.parametrize("depth", DEPTHS)
def test_full_and_standard(depth):
    L = 2 * depth
    g = parse_spec(spec_text(depth, "full_attnres")).ir()
    s = summary(g)
    assert [a["sources"] for a in s["aggregations"]] == [
        ["embedding"] + [f"sublayer{i}" for i in range(1, l)] for l in range(1, L + 2)]
    assert live_values_per_token(g) == L + 1
    # Full AttnRes is Block AttnRes with one block per sublayer
    full_as_block = parse_spec(spec_text(depth, f"block_attnres(blocks: {L})")).ir()
    assert [a["sources"] for a in summary(full_as_block)["aggregations"]] == \
        [a["sources"] for a in s["aggregations"]]
    assert live_values_per_token(parse_spec(spec_text(depth, "standard")).ir()) == 1


@pytest.mark.parametrize("depth", [1, 3, 8])
@pytest.mark.parametrize("gate", ["none", "softmax", "sigmoid"])
def test_static_scalars(depth, gate):
    """Scalars read the sources of Full AttnRes with one parameter per source (whatever the
    gate), keep every source live, and are never batched as two-phase depth attention."""
    L = 2 * depth
    g = parse_spec(spec_text(depth, f"denseformer(gate: {gate})")).ir()
    s = summary(g)
    assert [a["sources"] for a in s["aggregations"]] == [
        ["embedding"] + [f"sublayer{i}" for i in range(1, l)] for l in range(1, L + 2)]
    assert [(a["method"], a["gate"]) for a in s["aggregations"]] == [("scalars", gate)] * (L + 1)
    assert s["added_parameters"] == (L + 1) * (L + 2) // 2
    assert live_values_per_token(g) == L + 1 and s["two_phase_groups"] == []


def test_rule_gate_defaults_per_method():
    """A rule without a gate takes its method's default: DenseFormer's raw scalars, the
    softmax of depth attention; a gate the method does not know is refused."""
    from restopo.topology import STANDARD_SOURCES, Rule
    assert Rule("scalars", STANDARD_SOURCES) == Rule("scalars", STANDARD_SOURCES, gate="none")
    assert Rule("attend", STANDARD_SOURCES).gate == "softmax"
    assert Rule("scalars", STANDARD_SOURCES, gate="softmax") != Rule("scalars", STANDARD_SOURCES)
    for method, gate in (("attend", "none"), ("scalars", "relu")):
        with pytest.raises(ValueError, match="takes gate"):
            Rule(method, STANDARD_SOURCES, gate=gate)


@pytest.mark.parametrize("depth,window", [(4, 1), (4, 3), (8, 8), (16, 8), (3, 20)])
def test_sliding_window(depth, window):
    g = parse_spec(spec_text(depth, f"full_attnres(window: {window})")).ir()
    L = 2 * depth
    want = [["embedding"] + [f"sublayer{i}" for i in range(max(1, l - window), l)]
            for l in range(1, L + 2)]
    assert [a["sources"] for a in summary(g)["aggregations"]] == want
    assert live_values_per_token(g) == min(window, L) + 1


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_blocks_outside_the_allowed_set_are_rejected(depth):
    from restopo.spec import SpecError
    allowed = set(range(1, depth + 1)) | {2 * depth}
    for n in range(1, 2 * depth + 3):
        if n in allowed:
            continue
        with pytest.raises(SpecError, match="blocks must be between"):
            parse_spec(spec_text(depth, f"block_attnres(blocks: {n})"))


def test_examples_live_values():
    """Live values per token of every example against attnres.md: standard and the
    single-stream family 1, Block N + 1, Full (and DenseFormer, which reads every source)
    L + 1, the sliding window w + 1; n streams (hyper.md) n."""
    from pathlib import Path

    from restopo.spec import load_spec
    want = {"standard": 1, "rezero": 1, "layerscale": 1, "highway": 1,
            "block_attnres": 9, "block_heads16": 9, "block_no_key_norm": 9, "custom_wiring": 9,
            "full_attnres": 33, "full_input_dependent": 33, "full_sigmoid": 33,
            "full_no_key_norm": 33, "full_scalars": 33, "denseformer": 33,
            "full_window8": 9, "tiny": 3, "mhc": 4, "hyper_connections": 4}
    examples = Path(__file__).resolve().parent.parent / "examples"
    got = {p.stem: live_values_per_token(load_spec(p).ir())
           for p in sorted(examples.glob("*.restopo"))}
    assert got == want


@pytest.mark.parametrize("depth,n", [(4, 2), (6, 3), (8, 8), (5, 2)])
def test_two_phase_groups_follow_the_blocks(depth, n):
    """Static-query softmax aggregations of one block read the same completed blocks: one
    phase-1 group per block of two or more sublayers; an input-dependent query or a
    sigmoid gate leaves nothing to batch."""
    from restopo.ir import two_phase_plan
    g = parse_spec(spec_text(depth, f"block_attnres(blocks: {n})")).ir()
    sizes = block_sizes_by_count(depth, n)
    plan = two_phase_plan(g)
    first = [sum(sizes[:b]) + 1 for b in range(len(sizes))]
    want = [tuple(f"agg{i}" for i in range(f, f + size)) for f, size in zip(first, sizes)
            if size >= 2]
    assert [p.members for p in plan] == want
    for p in plan:
        assert p.partials[0] is None and all(x is not None for x in p.partials[1:])
    for opt in ("query: input_dependent", "gate: sigmoid"):
        g = parse_spec(spec_text(depth, f"block_attnres(blocks: {n}, {opt})")).ir()
        assert two_phase_plan(g) == []


@pytest.mark.parametrize("depth", [3, 8])
def test_a_plain_sum_no_running_value_feeds_keeps_its_sources_live(depth):
    """Sublayers attend over a window and the head sums every output: no running value feeds
    that sum (the point before it kept none), so the lowering sums it from its L + 1
    sources, all kept until the head. inspect said 4 (it folded them into one running
    value, as for the standard residual), and FLOPs counted that sum as one add, not L."""
    from restopo.nn.flops import aggregation_flops
    L, d = 2 * depth, 16
    custom = ("custom {\n  before sublayer: attend(embedding, window(2))\n"
              "  before head: sum(embedding, sublayers)\n}")
    g = parse_spec(spec_text(depth, custom)).ir()
    assert live_values_per_token(g) == L + 1
    windowed = parse_spec(spec_text(depth, "full_attnres(window: 2)")).ir()
    attend = sum(len(a.sources) * 6 * d for a in windowed.aggregations()[:-1])
    assert aggregation_flops(g, d) == attend + L * d  # the head: L adds of d
    # the standard residual's head is fed by its running value: one live value, one add
    assert live_values_per_token(parse_spec(spec_text(depth, "standard")).ir()) == 1
