"""The pipelined model against the same model in one process, and its traffic against the plan.

Multi-process checks launch `restopo.backends.pipeline.selfcheck` under torchrun (gloo on
127.0.0.1, OMP_NUM_THREADS=1, a timeout); one launch runs every schedule with caching off
and on. In-process checks chain the chunk modules of every rank by hand.
"""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from restopo.api import build_model
from restopo.backends.pipeline.plan import make_plan
from restopo.backends.pipeline.selfcheck import table
from restopo.backends.pipeline.stage import build_chunks
from restopo.fx.lower import aggregation_modules, parts_of
from restopo.topology import (STANDARD_SOURCES, Rule, Source, Topology, block_attnres,
                              full_attnres, hyper_connections, mhc, partition_by_count,
                              standard, sublayer_kinds)

SPEC = types.SimpleNamespace(vocab=32, width=16, depth=4, heads=2, mlp="swiglu",
                             mlp_ratio=2.0, context=8, tie_embeddings=True)
KINDS = sublayer_kinds(4)


def _custom(name, rule, head=None):
    return Topology(name, partition_by_count(KINDS, 1), rule, head or rule)


TOPOLOGIES = {
    "standard": standard(KINDS),
    "full": full_attnres(KINDS),
    "block2": block_attnres(KINDS, blocks=2),
    "block_size4": block_attnres(KINDS, block_size=4),
    "window": _custom("window", Rule("attend", (Source("embedding"), Source("window", 2)))),
    "scalars": _custom("dense", Rule("scalars", STANDARD_SOURCES)),
    "rezero": _custom("rezero", Rule("rezero", STANDARD_SOURCES)),
    "highway": _custom("highway", Rule("highway", STANDARD_SOURCES)),
    "input_query": block_attnres(KINDS, blocks=2, query="input_dependent"),
    "mhc": mhc(KINDS, 4),
    "dhc": hyper_connections(KINDS, 3, dynamic=True),
}


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("P,V,cuts", [(2, 2, None), (4, 2, None),
                                      (2, 2, [3, 5, 7])])
@pytest.mark.parametrize("cached", [False, True])
def test_chunks_chained_equal_the_model(name, P, V, cuts, cached):
    """Every rank's chunks, run in chunk order, compute the single-process logits: each
    chunk finds every value it reads among what it received, its rank's cache or itself."""
    torch.manual_seed(0)
    model = build_model(SPEC, TOPOLOGIES[name], backend="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "pseudo_query" in n or "query_proj" in n:
                p.normal_(0, 0.3)
    g = model.restopo_ir
    plan = make_plan(g, P, V, cuts=cuts)
    chunks = {}
    for r in range(P):
        for m in build_chunks(plan, g, parts_of(model), aggregation_modules(model), r,
                              cached=cached):
            chunks[m.c] = m
    idx = torch.randint(0, 32, (2, 8))
    x = (idx,)
    for c in range(plan.n_chunks):
        x = chunks[c](*x)
        if c < plan.n_chunks - 1:
            assert len(x) == len(plan.outputs(c, cached))
            assert all(t.is_contiguous() for t in x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=1e-5)
    # every parameter belongs to exactly the chunks that use it; together they cover the model
    owned = {id(p) for m in chunks.values() for p in m.parameters()}
    assert owned == {id(p) for p in model.parameters()}


def test_chunks_keep_the_two_phase_plan():
    """A chunk runs phase 1 / phase 2 for the groups whose members it owns: with P = 2 and a
    cut inside the second block, each chunk batches the members of block 2 it holds."""
    model = build_model(SPEC, TOPOLOGIES["block2"], backend="eager")
    g = model.restopo_ir
    plan = make_plan(g, 2, 1, cuts=[6])
    c0, c1 = (build_chunks(plan, g, parts_of(model), aggregation_modules(model), r)[0]
              for r in range(2))
    assert [grp.members for grp in c0.groups] == [("agg1", "agg2", "agg3", "agg4"),
                                                  ("agg5", "agg6")]
    assert [grp.members for grp in c1.groups] == [("agg7", "agg8")]
    assert c1.groups[0].partials == ("partial2.3", "partial2.4")
    idx = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(c1(*c0(idx)), model(idx), rtol=0, atol=1e-5)


def launch(pipeline, topology="block:4", depth=4, schedules="", cuts="", timeout=150):
    P = int(pipeline.split("x")[0])
    out = os.path.join(os.environ.get("PYTEST_TMP", "/tmp"),
                       f"restopo_pp_{os.getpid()}_{pipeline}_{topology.replace(':', '')}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={P}", "-m", "restopo.backends.pipeline.selfcheck",
           "--pipeline", pipeline, "--topology", topology, "--depth", str(depth),
           "--microbatches", str(max(P, 2)), "--out", out]
    if schedules:
        cmd += ["--schedules", schedules]
    if cuts:
        cmd += ["--cuts", cuts]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        rows = json.load(f)
    os.remove(out)
    print(table(rows))
    return rows


def check(rows, schedules=3):
    assert len(rows) == 2 * schedules
    for r in rows:
        where = f"{r['pipeline']} {r['schedule']} cached={r['cached']}"
        assert r["loss_err"] <= 1e-5, where
        assert r["grad_err"] <= 1e-5, where
        assert r["params_checked"] == r["params_total"], where
        # bytes counted at the send calls equal the plan, forward and backward
        assert r["measured_fwd_bytes"] == r["plan_bytes"], where
        assert r["measured_bwd_bytes"] == r["plan_bytes"], where


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["2x1", "2x2", "4x2"])
def test_pipeline_equals_single_process(pipeline):
    # block:4 over 8 sublayers: blocks of 2, so the 4x2 cuts alternate between inside a
    # block (a partial crosses) and on a block boundary
    check(launch(pipeline))


@pytest.mark.slow
def test_traffic_matches_the_formula_when_chunks_complete_whole_blocks():
    # 16 sublayers, 8 blocks of one layer, 8 chunks: N_p = 1 per chunk, every cut aligned
    rows = launch("4x2", topology="block:8", depth=8, schedules="interleaved_1f1b")
    check(rows, schedules=1)
    naive, cached = rows
    assert (naive["naive_blocks"], naive["cached_blocks"], naive["bound_blocks"]) == (28, 18, 22)
    per_vector = 2 * 8 * 16 * 4          # microbatch of 2 x 8 tokens, d = 16, fp32
    # blocks + embedding (C-1 = 7 naive, P-1 = 3 cached), no open partial at aligned cuts
    assert naive["measured_fwd_bytes"] == (28 + 7) * per_vector
    assert cached["measured_fwd_bytes"] == (18 + 3) * per_vector


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["full", "standard"])
def test_full_and_standard(topology):
    rows = launch("2x2", topology=topology, depth=2, schedules="1f1b")
    check(rows, schedules=1)
    if topology == "standard":   # one hidden state per hop, 3 hops
        assert rows[0]["measured_fwd_bytes"] == rows[1]["measured_fwd_bytes"] == 3 * 2 * 8 * 16 * 4


@pytest.mark.slow
def test_multi_stream_state_crosses_every_cut():
    """mHC with n = 4: the whole [b, T, 4, d] state crosses each of the 3 hops, forward and
    backward, and the pipelined step equals the single process."""
    rows = launch("2x2", topology="mhc:4", depth=2, schedules="1f1b")
    check(rows, schedules=1)
    for r in rows:
        assert r["plan_streams"] == 3 * 4
        assert r["measured_fwd_bytes"] == r["measured_bwd_bytes"] == 3 * 4 * 2 * 8 * 16 * 4
