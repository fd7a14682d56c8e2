"""Pictures of the IR (restopo.draw): what they show is the computation model.code runs, under
the names model.code uses, with edges that stay few as the model gets deep."""
import re

import pytest

import restopo
from restopo.draw.scene import build_scene
from restopo.spec import parse_spec

MODEL = "model m {{ vocab: 64; width: 16; depth: {depth}; heads: 2; context: 8 }}\n"


def scene_of(residual, depth=16):
    spec = parse_spec(MODEL.format(depth=depth) + f"residual {residual}\n")
    return build_scene(spec.ir(), "t"), restopo.compile(spec, backend="eager").code


@pytest.mark.parametrize("residual", ["block_attnres(blocks: 8)", "full_attnres", "standard",
                                      "full_attnres(window: 4)", "denseformer",
                                      "mhc(streams: 2)", "block_attnres(block_size: 6)"])
def test_names_are_model_code_names(residual):
    scene, code = scene_of(residual)
    names = set(re.findall(r"^\s*(\w+) = ", code, re.M))  # the values model.code assigns
    for box in scene.boxes.values():
        if box.kind in ("aggregation", "head", "embedding"):
            continue  # h_l and logits name the points; an identity h_l has no line of its own
        assert box.name in names, f"{box.name} is not a name in model.code"


def test_block_attnres_reads_through_phase_one_and_a_bus():
    """32 sublayers in 8 blocks: each block's phase 1 reads the completed blocks (the bus
    once it is three or more), each sublayer reads its phase 1 and its own partial."""
    scene, _ = scene_of("block_attnres(blocks: 8)")
    edges = {(e.src, e.dst, e.kind) for e in scene.edges}
    assert ("block1", "block2_phase1", "reads") in edges  # two values: explicit edges
    assert ("embedding", "block2_phase1", "reads") in edges
    assert ("bus", "block5_phase1", "bus") in edges and ("block4", "bus", "bus") in edges
    assert ("block5_phase1", "agg18", "phase") in edges
    assert ("partial5.3", "agg19", "reads") in edges  # ids are the IR's; names model.code's
    assert scene.boxes["partial5.3"].name == "partial5_3"
    assert ("sublayer17", "agg18", "reads") in edges  # p_5^2 is sublayer17 itself
    reads = sum(len(a.sources) for a in parse_spec(
        MODEL.format(depth=16) + "residual block_attnres(blocks: 8)\n").ir().aggregations())
    assert len(scene.edges) < 0.8 * reads + 2 * 33  # far fewer than one per read


@pytest.mark.parametrize("residual, depth", [("block_attnres(blocks: 8)", 16),
                                             ("block_attnres(blocks: 3)", 3)])
def test_each_phase_one_is_drawn_reading_exactly_its_completed_blocks(residual, depth):
    """The DOT drew no edge from block n-1 into block n's phase 1 (n >= 3): the phase box
    sat above that block's sum, and the bus is expanded by rows (a tap reads what joined
    above it). Every drawn reader now has exactly the IR's sources."""
    from restopo.draw.dot import to_dot
    from restopo.ir import two_phase_plan

    g = parse_spec(MODEL.format(depth=depth) + f"residual {residual}\n").ir()
    drawn = {}
    for src, dst in re.findall(r'^  "([^"]+)" -> "([^"]+)"', to_dot(g), re.M):
        drawn.setdefault(dst, set()).add(src)
    for grp in two_phase_plan(g):
        phase = f"block{g.node(grp.members[0]).block}_phase1"
        assert drawn.get(phase, set()) == set(grp.completed), phase


@pytest.mark.parametrize("depth", [4, 16, 32])
def test_full_attnres_edges_grow_linearly(depth):
    scene, _ = scene_of("full_attnres", depth)
    L = 2 * depth
    assert scene.bus is not None
    assert len(scene.edges) <= 5 * (L + 1)  # the reads alone are (L + 1)(L + 2) / 2


def test_graph_of_a_deep_block_model_draws(tmp_path):
    from restopo.cli import main

    spec = tmp_path / "b.restopo"
    spec.write_text(MODEL.format(depth=16) + "residual block_attnres(blocks: 8)\n")
    for suffix, engine in ((".png", ["--engine", "matplotlib"]), (".dot", [])):
        out = tmp_path / f"g{suffix}"
        assert main(["graph", str(spec), "-o", str(out), *engine]) == 0
        assert out.stat().st_size > 1000
    dot = (tmp_path / "g.dot").read_text()
    assert '"block3_phase1" -> "agg9"' in dot and "concentrate=true" in dot
