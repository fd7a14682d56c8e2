"""The pipeline plan against the formulas of attnres.md and the issue, from the IR alone."""
import json

import pytest

from restopo.backends.pipeline.plan import PlanError, balance, make_plan, parse_pv
from restopo.backends.pipeline.report import describe, to_json
from restopo.ir.build import build_ir
from restopo.topology import (block_attnres, full_attnres, partition_by_count, standard,
                              sublayer_kinds, Topology)

EQUAL = {"attn": 1.0, "mlp": 1.0}


def block_ir(depth, blocks, width=8):
    k = sublayer_kinds(depth)
    return build_ir(k, block_attnres(k, blocks=blocks), width)


def formula_naive_blocks(P, V, n_p):
    C = P * V
    return C * (C - 1) // 2 * n_p


def formula_cached_blocks(P, V, n_p):
    return P * (P - 1) // 2 * n_p + (V - 1) * P * (P - 1) * n_p


@pytest.mark.parametrize("P,V,n_p", [(2, 1, 1), (2, 2, 1), (4, 2, 1), (3, 3, 1), (2, 3, 2),
                                     (4, 2, 2), (8, 4, 1), (1, 4, 1), (5, 1, 3)])
def test_aligned_chunks_match_the_formulas(P, V, n_p):
    C = P * V
    g = block_ir(depth=C * n_p, blocks=C * n_p)       # one transformer layer per block
    plan = make_plan(g, P, V, costs=EQUAL)
    assert plan.uniform_np == n_p
    assert plan.vectors(False, "block") == formula_naive_blocks(P, V, n_p)
    assert plan.vectors(True, "block") == (formula_cached_blocks(P, V, n_p) if P > 1 else 0)
    assert plan.vectors(False, "embedding") == C - 1
    assert plan.vectors(True, "embedding") == (P - 1)
    # every cut falls on a block boundary: the running partial there *is* the block just
    # completed, counted once as a block; no separate partial crosses
    assert plan.vectors(False, "hidden") == plan.vectors(True, "hidden") == 0
    bound = P * (P - 1) / 2 * n_p + (V - 1) * P * P * n_p
    assert plan.paper_bound_blocks == pytest.approx(bound)
    assert plan.vectors(True, "block") <= bound


@pytest.mark.parametrize("P,V", [(2, 1), (2, 2), (4, 2), (3, 2)])
def test_cuts_inside_blocks_send_the_hidden_partial_at_every_hop(P, V):
    # blocks of one layer (2 sublayers); every cut one sublayer into a block, so each chunk
    # still completes exactly N_p = 2 blocks and a partial is open at every cut
    C, n_p = P * V, 2
    depth = C * n_p
    g = block_ir(depth, depth)
    cuts = [2 * n_p * c + 1 for c in range(1, C)]
    plan = make_plan(g, P, V, cuts=cuts)
    assert plan.uniform_np is None or plan.uniform_np == n_p
    assert plan.blocks_per_chunk[1:-1] == (n_p,) * (C - 2)
    assert plan.vectors(False, "hidden") == plan.vectors(True, "hidden") == C - 1
    assert all(h.naive[-1].kind == "partial" and h.cached[-1].kind == "partial"
               for h in plan.hops)
    # blocks completed before cut c are exactly those of the chunks before it
    done = 0
    for c, h in enumerate(plan.hops):
        done += plan.blocks_per_chunk[c]
        assert sum(v.kind == "block" for v in h.naive) == done


def test_paper_example_4x2():
    plan = make_plan(block_ir(8, 8), 4, 2, costs=EQUAL)
    assert (plan.vectors(False, "block"), plan.vectors(True, "block"),
            plan.paper_bound_blocks) == (28, 18, 22)
    plan = make_plan(block_ir(32, 32), 8, 4, costs=EQUAL)
    assert (plan.vectors(False, "block"), plan.paper_bound_blocks) == (496, 220)


def test_cached_hop_sends_only_what_the_rank_has_not_seen():
    plan = make_plan(block_ir(8, 8), 4, 2, costs=EQUAL)
    seen = {r: set() for r in range(4)}
    seen[0].add("embedding")
    for c, hop in enumerate(plan.hops):
        seen[hop.src_rank].update(f"block{n}" for n in plan.chunks[c].blocks_completed)
        names = [v.name for v in hop.cached]
        assert not set(names) & seen[hop.dst_rank]
        assert set(names) == {v.name for v in hop.naive} - seen[hop.dst_rank]
        seen[hop.dst_rank].update(names)
    # in steady state a hop carries the blocks of the P-1 chunks that ran elsewhere since
    assert [len(h.cached) for h in plan.hops[3:]] == [3, 3, 3, 3]


def test_full_attnres_every_sublayer_is_a_block():
    k = sublayer_kinds(4)
    plan = make_plan(build_ir(k, full_attnres(k), 8), 2, 2, costs=EQUAL)
    assert plan.uniform_np == 2
    assert plan.vectors(False, "block") == formula_naive_blocks(2, 2, 2)
    assert plan.vectors(True, "block") == formula_cached_blocks(2, 2, 2)


def test_standard_sends_one_hidden_state_per_hop():
    k = sublayer_kinds(4)
    plan = make_plan(build_ir(k, standard(k), 8), 2, 2)
    assert [[v.name for v in h.naive] for h in plan.hops] == [["stream"]] * 3
    assert plan.vectors(False) == plan.vectors(True) == 3
    assert plan.bytes_per_token(True) == 3 * 8 * 4


def test_window_sources_cross_individually():
    from restopo.topology import Rule, Source
    k = sublayer_kinds(4)
    rule = Rule("attend", (Source("embedding"), Source("window", 2)))
    topo = Topology("window", partition_by_count(k, 1), rule, rule)
    plan = make_plan(build_ir(k, topo, 8), 2, 1, cuts=[4])
    # after sublayer 4: aggregations 5.. read sublayers 3,4 (window 2) and the embedding
    assert [v.name for v in plan.hops[0].naive] == ["embedding", "sublayer3", "sublayer4"]


def test_balance_is_contiguous_nonempty_and_minimises_the_largest_chunk():
    w = [4, 1, 1, 1, 1, 4, 2, 2]
    cuts = balance(w, 3)
    bounds = [0] + cuts + [len(w)]
    sums = [sum(w[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    # brute force over every split
    import itertools
    best = min(max(sum(w[a:b]) for a, b in zip((0,) + c, c + (len(w),)))
               for c in itertools.combinations(range(1, len(w)), 2))
    assert max(sums) == best


def test_balance_weighs_kinds_and_prefers_block_boundaries():
    k = sublayer_kinds(4)
    g = build_ir(k, block_attnres(k, blocks=2), 8)
    # attention three times the MLP: the 8 sublayers weigh 3,1,3,1,...: halves at 4
    plan = make_plan(g, 2, 1, costs={"attn": 3, "mlp": 1})
    assert plan.chunks[0].sublayers == (1, 2, 3, 4)
    # balance first: 6 equal sublayers split 3/3 even though the cut is inside a layer
    plan = make_plan(block_ir(3, 3), 2, 1, costs={"attn": 1, "mlp": 1})
    assert plan.chunks[0].sublayers == (1, 2, 3)
    # among equally balanced splits, the one on a preferred (block) boundary wins
    assert balance([1] * 5, 2, aligned={3}) == [3]
    assert balance([1] * 5, 2, aligned={2}) == [2]


def test_errors_are_clear():
    with pytest.raises(PlanError, match="at most 8 chunks"):
        make_plan(block_ir(4, 4), 4, 3)
    with pytest.raises(PlanError, match="STAGESxVIRTUAL"):
        parse_pv("4by2")
    assert parse_pv("4x2") == (4, 2) and parse_pv("3") == (3, 1)


def test_reports():
    plan = make_plan(block_ir(8, 8, width=64), 4, 2, costs=EQUAL)
    data = json.loads(json.dumps(to_json(plan)))
    t = data["totals"]
    assert t["naive"]["blocks"] == 28 and t["cached"]["blocks"] == 18
    assert t["paper_bound_blocks"] == 22
    assert t["cached"]["bytes_per_token"] == t["cached"]["vectors_per_token"] * 64 * 4
    assert len(data["chunk_table"]) == 8 and len(data["hops"]) == 7
    text = describe(plan)
    assert "naive" in text and "cached" in text and "22" in text


def test_report_counts_one_thing_in_the_singular():
    k = sublayer_kinds(4)
    text = describe(make_plan(build_ir(k, standard(k), 8), 1, 1, costs=EQUAL))
    assert text.splitlines()[0] == ("pipeline 1x1: 1 chunk on 1 rank (chunk c on rank c mod "
                                    "1); topology standard, 1 block")


def test_inspect_pipeline_cli(capsys):
    from restopo.cli import main
    assert main(["inspect", "examples/block_attnres.restopo", "--pipeline", "4x2",
                 "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)["pipeline"]
    assert (data["totals"]["naive"]["blocks"], data["totals"]["cached"]["blocks"],
            data["totals"]["paper_bound_blocks"]) == (28, 18, 22)
    assert data["totals"]["naive"]["bytes_per_token"] == 35 * 64 * 4
    assert main(["inspect", "examples/block_attnres.restopo", "--pipeline", "4x2"]) == 0
    text = capsys.readouterr().out
    assert "pipeline 4x2" in text and "paper's bound" in text
    # a topology that reads no completed block (multi-stream, standard) has no such bound
    for example in ("mhc", "standard"):
        assert main(["inspect", f"examples/{example}.restopo", "--pipeline", "2x2"]) == 0
        text = capsys.readouterr().out
        assert "block transfers: none" in text and "paper's bound" not in text
    # a usage error: the console exits with status 2
    assert main(["inspect", "examples/block_attnres.restopo", "--pipeline", "40x2"]) == 2
    err = capsys.readouterr().err
    assert "at most 32 chunks" in err and "Traceback" not in err


@pytest.mark.parametrize("mlp,topology", [("swiglu(4x)", "block_attnres(blocks: 2)"),
                                          ("gelu(3x)", "full_attnres"),
                                          ("swiglu(2x)", "mhc(streams: 2)")])
def test_chunk_costs_are_the_flops_inspect_reports(mlp, topology, tmp_path, capsys):
    """The plan weighed an MLP as 3 ratio d^2 (multiply-adds), where the SwiGLU the model
    builds has 2/3 of ratio d hidden units, and left the topology's own work out (with Full
    AttnRes, more the later the chunk). Its chunk costs now add up to inspect's forward
    FLOPs, and an MLP's is twice the matrix entries of the one the model builds."""
    from restopo.api import compile as compile_spec
    from restopo.backends.pipeline.plan import model_costs
    from restopo.cli import main
    from restopo.nn.sublayers import MLP
    spec = tmp_path / "m.restopo"
    spec.write_text(f"model m {{ vocab: 50; width: 40; depth: 3; heads: 2; context: 16; "
                    f"mlp: {mlp} }}\nresidual {topology}\n")
    assert main(["inspect", str(spec), "--pipeline", "3x2", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    chunks = report["pipeline"]["chunk_table"]
    assert [c["sublayers"] for c in chunks] == [[i, i] for i in range(1, 7)]
    assert sum(c["cost"] for c in chunks) == pytest.approx(report["flops_per_token"]["forward"])
    model = compile_spec(str(spec))
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    costs = model_costs(model.restopo_spec.model, model.restopo_ir)["costs"]
    assert len(mlps) == 3 and costs["mlp"] == 2 * sum(
        p.numel() for p in mlps[0].parameters() if p.dim() == 2)


def test_inspect_plans_the_spec_s_own_pipeline(tmp_path, capsys):
    """A spec whose parallel section asks for a pipeline is planned as train runs it, with
    no --pipeline (inspect showed none); --pipeline still wins; a spec without one shows no
    pipeline section."""
    from restopo.cli import main
    spec = tmp_path / "p.restopo"
    spec.write_text(PARALLEL_SPEC.format(pipeline="stages: 2, virtual: 2, microbatches: 4"))

    def pipeline(*flags):
        assert main(["inspect", str(spec), "--format", "json", *flags]) == 0
        return json.loads(capsys.readouterr().out).get("pipeline")

    assert pipeline() == pipeline("--pipeline", "2x2") != pipeline("--pipeline", "2x1")
    spec.write_text(PARALLEL_SPEC.format(pipeline="stages: 1"))
    assert pipeline() is None


@pytest.mark.parametrize("pv", ["1x1", "1x2"])
def test_a_one_stage_pipeline_is_refused_as_train_refuses_it(pv, capsys):
    """inspect planned --pipeline 1x2 (and check passed stages: 1, virtual: 2) that train
    then refused with 'a pipeline needs at least 2 stages'."""
    from restopo.cli import main
    assert main(["inspect", "examples/block_attnres.restopo", "--pipeline", pv]) == 2
    err = capsys.readouterr().err
    assert f"a pipeline needs at least 2 stages; got {pv}" in err and "Traceback" not in err


PARALLEL_SPEC = """model m {{ vocab: 64; width: 16; depth: 4; heads: 2; context: 8 }}
residual block_attnres(blocks: 2)
parallel {{ pipeline({pipeline}) }}
train {{ steps: 2; batch: 8 }}
"""


def test_gpipe_over_virtual_stages_checks_as_the_runtime_runs_it():
    """The runtime runs gpipe over virtual stages looped (ScheduleLoopedBFS; the 2x2 case of
    test_pipeline_equals_single_process), which check refused; 1f1b there is refused,
    naming interleaved_1f1b, the schedule it would be."""
    from restopo.spec import SpecError, parse_spec
    spec = parse_spec(PARALLEL_SPEC.format(
        pipeline="stages: 2, virtual: 2, schedule: gpipe, microbatches: 4"), "p.restopo")
    assert (spec.parallel.stages, spec.parallel.virtual, spec.parallel.schedule) == \
        (2, 2, "gpipe")
    with pytest.raises(SpecError, match="schedule 1f1b runs one chunk per stage"):
        parse_spec(PARALLEL_SPEC.format(pipeline="stages: 2, virtual: 2, schedule: 1f1b"),
                   "p.restopo")


def test_a_pipeline_flag_with_more_stages_than_the_spec_s_microbatches_is_refused(capsys):
    """check holds parallel microbatches against the spec's own stages; --pipeline 4x1 over
    a spec of 2 stages and 2 microbatches left stages idle without a word."""
    from restopo.backends.pipeline.train import PipelineConfig
    from restopo.backends.pipeline.plan import PlanError
    from restopo.spec import parse_spec
    spec = parse_spec(PARALLEL_SPEC.format(pipeline="stages: 2, microbatches: 2"), "p.restopo")
    assert PipelineConfig.resolve("2x2", spec.parallel).microbatches == 2
    with pytest.raises(PlanError, match=r"--pipeline 4x1 has more stages than the spec's "
                       r"parallel microbatches \(2\).*--set parallel.microbatches=4"):
        PipelineConfig.resolve("4x1", spec.parallel)


@pytest.mark.parametrize("method", ["rezero", "layerscale", "highway"])
def test_stream_updates_send_one_running_value(method):
    from restopo.topology import STANDARD_SOURCES, Rule
    k = sublayer_kinds(4)
    rule = Rule(method, STANDARD_SOURCES)
    plan = make_plan(build_ir(k, Topology(method, partition_by_count(k, 1), rule, rule), 8),
                     2, 2)
    assert [[v.name for v in h.cached] for h in plan.hops] == [["stream"]] * 3
    # the update after a chunk's last sublayer belongs to that chunk (so h_{s+1} crosses)
    assert all(c.sublayers[-1] + 1 in c.aggregations for c in plan.chunks)


def test_denseformer_sends_every_output_once_per_rank():
    from restopo.topology import STANDARD_SOURCES, Rule
    k = sublayer_kinds(4)
    rule = Rule("scalars", STANDARD_SOURCES)
    plan = make_plan(build_ir(k, Topology("dense", partition_by_count(k, 1), rule, rule), 8),
                     2, 2, costs=EQUAL)
    # naive: every output so far at every hop; cached: only those the rank has not seen
    assert [len(h.naive) for h in plan.hops] == [3, 5, 7]
    # rank 1 received 1-2 at the first hop and produced 3-4 itself
    assert [v.name for v in plan.hops[2].cached] == ["sublayer5", "sublayer6"]


def test_multi_stream_state_crosses_every_cut_whole():
    """n streams: every hop sends the n * d state, naive and cached alike (it changes at
    every sublayer, so there is nothing to cache), and the byte count includes all of it."""
    from restopo.topology import mhc, sublayer_kinds
    kinds = sublayer_kinds(8)
    g = build_ir(kinds, mhc(kinds, 4), 32)
    plan = make_plan(g, 4, 1)
    for h in plan.hops:
        assert [v.name for v in h.naive] == [v.name for v in h.cached] == ["streams[4]"]
    assert plan.vectors(False) == plan.vectors(True) == 3 * 4
    assert plan.bytes_per_token(True) == 3 * 4 * 32 * 4
    report = to_json(plan)
    assert [h["naive_vectors"] for h in report["hops"]] == [4, 4, 4]
    assert report["totals"]["cached"]["hidden"] == 12
