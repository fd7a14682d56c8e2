"""Residual memory I/O per token per sublayer (restopo.ir.memory_io) against the paper's
Table 1: standard 3d, mHC (n = 4) 34d + 48, Full AttnRes two-phase (S + N)d, Block AttnRes
two-phase (N/S + 5)d, at the paper's L = 128, N = 8, S = 16 and elsewhere."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from restopo import topology as T
from restopo.ir import build_ir, residual_io
from restopo.ir.memory_io import best_two_phase_full, two_phase_full

ROOT = Path(__file__).resolve().parents[1]


def _io(topology_fn, depth=64, **kw):
    kinds = T.sublayer_kinds(depth)
    return residual_io(build_ir(kinds, topology_fn(kinds, **kw), 64))


def test_standard_is_3d_at_every_sublayer():
    io = _io(T.standard)
    assert {(c.reads, c.writes, c.scalars) for c in io.per_sublayer} == {(2, 1, 0)}
    assert io.head.d == 0


@pytest.mark.parametrize("method,n", [(m, n) for m in ("mhc", "mhc_lite", "dhc")
                                      for n in (1, 2, 4, 8) if (m, n) != ("mhc_lite", 8)])
def test_mhc_rows(method, n):
    """(8n + 2)d + 2n^2 + 4n for every coefficient-generating variant: 34d + 48 at n = 4."""
    fn = {"mhc": T.mhc, "mhc_lite": T.mhc_lite,
          "dhc": lambda k, streams: T.hyper_connections(k, streams, dynamic=True)}[method]
    io = _io(fn, streams=n)
    assert {(c.d, c.scalars) for c in io.per_sublayer} == {(8 * n + 2, 2 * n * n + 4 * n)}
    assert io.peak.reads == 5 * n + 1 and io.peak.writes == 3 * n + 1
    if n == 4:
        assert str(io.peak) == "34d + 48"


def test_static_hc_skips_the_coefficient_read():
    io = _io(T.hyper_connections, streams=4)
    assert (io.peak.d, io.peak.scalars) == (30, 24)  # (7n + 2)d + n^2 + 2n


def test_block_attnres_two_phase_is_n_over_s_plus_5():
    """L = 128, N = 8 (S = 16): phase 1 of the last block reads its 8 completed sources
    (b_0..b_7) once for 16 sublayers: 8/16 + 5 = 5.5d."""
    io = _io(T.block_attnres, depth=64, blocks=8)
    assert io.peak.d == pytest.approx(8 / 16 + 5)
    # block n's sublayers read n sources in phase 1: the mean is (N + 1)/2 / S + 5
    assert io.mean == pytest.approx((8 + 1) / 2 / 16 + 5)
    for N, depth in ((4, 16), (2, 8), (16, 64)):
        S = 2 * depth // N
        assert _io(T.block_attnres, depth=depth, blocks=N).peak.d == pytest.approx(N / S + 5)


def test_block_without_two_phase_counts_its_running_sums():
    """An input-dependent query cannot be batched in phase 1: each point reads its sources
    directly, and the partial sums are running adds (3d each)."""
    io = _io(T.block_attnres, depth=8, blocks=2, query="input_dependent")
    # last sublayer of the last block: reads b_0, b_1 and its partial, writes h; and the
    # running sum that adds its own output to the block (read 2, write 1)
    assert io.per_sublayer[-1].d == 3 + 1 + 3
    assert io.per_sublayer[8].d == 2 + 1  # first sublayer of block 2: b_0, b_1; no add yet


def test_full_attnres_two_phase_is_s_plus_n():
    """Full AttnRes at L = 128 grouped as the paper does (N = 8 groups of S = 16): phase 1
    of the last group reads the embedding and 112 outputs once for 16 sublayers, phase 2
    reads at most S - 1 = 15 in-group outputs: (S + N)d, plus the embedding's d/S that the
    paper leaves out."""
    kinds = T.sublayer_kinds(64)
    g = build_ir(kinds, T.full_attnres(kinds), 64)
    assert two_phase_full(g, 16).peak.d == pytest.approx(16 + 8 + 1 / 16)
    assert two_phase_full(g, 8).peak.d == pytest.approx(8 + 16 + 1 / 8)
    best = best_two_phase_full(g)
    assert best.peak.d == pytest.approx(24 + 1 / 16)  # S + N is least at S = 16 or 8
    # as restopo runs it, directly: the last sublayer reads the embedding and 127 outputs
    direct = residual_io(g)
    assert direct.peak.d == 128 + 1 and direct.mean == pytest.approx((128 + 3) / 2)


def test_topologies_without_direct_attention_have_no_two_phase_figure():
    kinds = T.sublayer_kinds(4)
    for top in (T.standard(kinds), T.mhc(kinds, 4), T.block_attnres(kinds, blocks=2)):
        assert best_two_phase_full(build_ir(kinds, top, 16)) is None


def _inspect(path: str) -> dict:
    import contextlib
    import io

    from restopo.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", path, "--format", "json"]) == 0
    return json.loads(out.getvalue())["residual_io"]


def test_inspect_json_gives_the_io_column_for_the_shipped_examples():
    std = _inspect(str(ROOT / "examples/standard.restopo"))
    assert (std["peak_d"], std["reads_d"], std["writes_d"]) == (3, 2, 1)
    mhc = _inspect(str(ROOT / "examples/mhc.restopo"))
    assert (mhc["peak_d"], mhc["scalars"]) == (34, 48)
    hc = _inspect(str(ROOT / "examples/hyper_connections.restopo"))
    assert (hc["peak_d"], hc["scalars"]) == (34, 48)  # dynamic HC: as mHC
    block = _inspect(str(ROOT / "examples/block_attnres.restopo"))  # 32 sublayers, N = 8
    assert block["peak_d"] == 8 / 4 + 5
    full = _inspect(str(ROOT / "examples/full_attnres.restopo"))
    assert full["two_phase_full"]["peak_d"] == 8 + 4 + 1 / 8 and full["peak_d"] == 33


def test_a_windowed_full_attnres_is_not_labelled_with_the_papers_full_formula():
    """inspect printed 'Table 1 Full AttnRes two-phase, (S + N)d + d/S' beside a window's
    grouped figure (6.5d where that formula gives 12.25d): the formula is said only where
    every grouped point reads all earlier outputs."""
    kinds = T.sublayer_kinds(16)
    full = best_two_phase_full(build_ir(kinds, T.full_attnres(kinds), 16))
    window = best_two_phase_full(build_ir(kinds, T.full_attnres(kinds, window=8), 16))
    S, N = 8, 4
    assert full.formula.startswith("Table 1 Full AttnRes") and \
        full.peak.d == pytest.approx(S + N + 1 / S)
    assert "Table 1" not in window.formula and window.peak.d < S + N


def test_inspect_prints_the_figures_unrounded():
    """Full AttnRes at L = 32 peaks at 12.125d grouped; the text said 12.12d (.4g)."""
    from restopo.commands.inspect import _d
    assert [_d(x) for x in (1, 3, 12.125, 24.0625, 5.09375)] == \
        ["d", "3d", "12.125d", "24.0625d", "5.09375d"]
