"""The language front-end: what parses, what the checked spec holds, overrides, positions."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import restopo
from restopo.spec import SpecError, SpecErrors, load_spec, parse_spec
from restopo.spec.resolve import resolve_residual
from restopo.topology import Rule, Source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

TINY = """\
# a comment
model tiny {
  vocab: 256; width: 64; depth: 4; heads: 4; mlp: gelu(2.5x); context: 64
  tie_embeddings: false   # trailing comment
}
residual block_attnres(blocks: 2, query: input_dependent, gate: sigmoid, key_norm: none, heads: 2)
parallel { pipeline(stages: 2, virtual: 2, schedule: interleaved_1f1b, microbatches: 8); cache: false }
train { data: builtin:stdlib; steps: 1k; batch: 8; lr: 3e-3; schedule: constant; warmup: 0
        min_lr: 1e-4; weight_decay: 0; grad_clip: 0; accum: 2; seed: 7 }
"""


def test_full_spec_values():
    spec = parse_spec(TINY, "tiny.restopo")
    m = spec.model
    assert (m.name, m.vocab, m.width, m.depth, m.heads, m.context) == ("tiny", 256, 64, 4, 4, 64)
    assert (m.mlp, m.mlp_ratio, m.tie_embeddings, m.layer) == ("gelu", 2.5, False, ("attn", "mlp"))
    assert m.kinds == ("attn", "mlp") * 4
    r = spec.residual
    assert (r.name, r.form, r.blocks, r.block_size) == ("block_attnres", "named", 2, None)
    assert dict(r.options) == {"query": "input_dependent", "gate": "sigmoid", "key_norm": "none",
                               "heads": 2}
    p = spec.parallel
    assert (p.stages, p.virtual, p.schedule, p.microbatches, p.cache) == (
        2, 2, "interleaved_1f1b", 8, False)
    t = spec.train
    assert (t.data, t.steps, t.batch, t.lr, t.schedule, t.warmup) == (
        "builtin:stdlib", 1000, 8, 3e-3, "constant", 0)
    assert (t.min_lr, t.weight_decay, t.grad_clip, t.accum, t.seed) == (1e-4, 0.0, 0.0, 2, 7)
    assert (t.eval_every, t.eval_batches, t.save_every, t.log_every) == (50, 8, 100, 10)
    assert spec.path == "tiny.restopo" and spec.text == TINY and spec.overrides == ()
    topo = spec.topology
    assert topo.sublayer_rule == Rule("attend", (Source("embedding"), Source("blocks"),
                                                 Source("partial")),
                                      "input_dependent", "sigmoid", "none", 2)
    assert spec.ir().n_sublayers == 8


def test_defaults_and_one_line_form():
    spec = parse_spec("model { vocab: 256; width: 64; depth: 2; heads: 2; context: 32 }\n"
                      "residual standard\nparallel pipeline(stages: 2)")
    assert spec.model.mlp == "swiglu" and spec.model.mlp_ratio == 4.0 and spec.model.tie_embeddings
    assert spec.train == restopo.spec.TrainSpec()
    assert spec.train.final_lr == pytest.approx(3e-4)
    assert spec.parallel.virtual == 1 and spec.parallel.schedule == "1f1b"
    assert spec.parallel.microbatches == 2 and spec.parallel.cache is True


def test_every_schedule_can_be_written_even_the_one_that_starts_with_a_digit():
    """`schedule: 1f1b` lexed as the two numbers '1f' '1b' ("takes one value, got 2"), so
    the default schedule could not be written, in the file or with --set."""
    M = "model { vocab: 256; width: 64; depth: 2; heads: 2; context: 32 }\nresidual standard\n"
    for schedule in ("gpipe", "1f1b"):
        spec = parse_spec(M + f"parallel pipeline(stages: 2, schedule: {schedule})")
        assert spec.parallel.schedule == schedule
        spec = parse_spec(M, overrides=("parallel.stages=2", f"parallel.schedule={schedule}"))
        assert spec.parallel.schedule == schedule
    with pytest.raises(SpecError) as e:
        parse_spec(M + "parallel pipeline(stages: 2, schedule: 1f1bb)")
    assert "unknown schedule '1f1bb'" in str(e.value) and "did you mean '1f1b'?" in str(e.value)


def test_separators_are_forgiving():
    """Newlines, ';', or nothing where the next 'key:' makes the boundary plain."""
    a = parse_spec("model { vocab: 256; width: 64; depth: 2; heads: 2; context: 32 }\n"
                   "residual full_attnres")
    b = parse_spec("model {\n vocab: 256\n width: 64\n depth: 2\n heads: 2\n context: 32\n}\n"
                   ";residual full_attnres;")
    c = parse_spec("model{vocab:256 width:64 depth:2 heads:2 context:32}residual full_attnres")
    assert a.model == b.model == c.model and a.residual == b.residual == c.residual


def test_sections_in_any_order_and_layer_list():
    spec = parse_spec("train { steps: 5 }\nresidual full_attnres\n"
                      "model { layer: attn mlp mlp\n vocab: 256; width: 64; depth: 2; heads: 2; "
                      "context: 32 }")
    assert spec.model.kinds == ("attn", "mlp", "mlp") * 2
    assert spec.topology.blocks == tuple((i,) for i in range(1, 7))


def test_numbers_with_units():
    spec = parse_spec("model { vocab: 32k; width: 1_024; depth: 1; heads: 8; context: 2k; "
                      "mlp_ratio: 8x }\nresidual standard\ntrain { lr: 1.5e-4; steps: 1M }")
    assert spec.model.vocab == 32_000 and spec.model.width == 1024 and spec.model.context == 2000
    assert spec.model.mlp_ratio == 8.0
    assert spec.train.lr == 1.5e-4 and spec.train.steps == 1_000_000


def test_residual_only_spec_is_valid_for_rewiring():
    spec = parse_spec("residual block_attnres(blocks: 4)", "rewire.restopo")
    assert spec.model is None and spec.parallel is None
    topo = resolve_residual(spec.residual, ("attn", "mlp") * 8)
    assert len(topo.blocks) == 4
    with pytest.raises(SpecError, match="needs a model section") as info:
        spec.topology
    assert (info.value.path, info.value.line, info.value.column) == ("rewire.restopo", 1, 10)
    with pytest.raises(SpecError, match="needs a model section"):
        spec.ir()


def test_resolve_errors_point_at_the_residual_line():
    spec = parse_spec("\nresidual block_attnres(blocks: 5)", "r.restopo")
    with pytest.raises(SpecError) as info:
        resolve_residual(spec.residual, ("attn", "mlp") * 4)
    e = info.value
    assert (e.path, e.line, e.column) == ("r.restopo", 2, 32)
    assert "1, 2, 3, 4 or 8" in e.hint
    assert "residual block_attnres(blocks: 5)" in str(e)


def test_custom_wiring_default_head_drops_partial():
    spec = parse_spec("model { vocab: 256; width: 64; depth: 4; heads: 4; context: 64 }\n"
                      "residual mine {\n blocks: 2\n"
                      " before sublayer: attend(embedding, blocks, partial; key_norm: none)\n}")
    r = spec.residual
    assert (r.name, r.form) == ("mine", "custom")
    assert r.head_rule.sources == (Source("embedding"), Source("blocks"))
    assert r.head_rule.key_norm == "none"
    assert spec.topology.name == "mine"


def test_overrides_apply_and_are_recorded():
    base = EXAMPLES / "tiny.restopo"
    spec = load_spec(base, overrides=("model.width=128", "residual.blocks=4", "train.steps=50",
                                      "parallel.stages=2"))
    assert spec.model.width == 128 and spec.residual.blocks == 4 and spec.train.steps == 50
    assert spec.parallel.stages == 2 and spec.parallel.microbatches == 2
    assert spec.overrides == ("model.width=128", "residual.blocks=4", "train.steps=50",
                              "parallel.stages=2")
    spec = load_spec(base, overrides=("residual=full_attnres(gate: sigmoid)",))
    assert spec.residual.name == "full_attnres" and spec.residual.option("gate") == "sigmoid"
    # setting one way of cutting blocks replaces the other
    spec = load_spec(EXAMPLES / "custom_wiring.restopo", overrides=("residual.blocks=4",))
    assert (spec.residual.blocks, spec.residual.block_size) == (4, None)
    spec = load_spec(base, overrides=("residual.block_size=4",))
    assert (spec.residual.blocks, spec.residual.block_size) == (None, 4)
    assert [len(b) for b in spec.topology.blocks] == [4, 4]
    # `custom` wiring needs its rules in braces, which a --set cannot give
    with pytest.raises(SpecError, match="unknown topology 'custom'"):
        load_spec(base, overrides=("residual=custom",))


def test_override_errors_collect_with_file_errors():
    text = "model { vocab: 256; width: 64; depth: 4; heads: 5; context: 64 }\nresidual standard"
    with pytest.raises(SpecErrors) as info:
        parse_spec(text, "f.restopo", ("model.dpeth=3", "train.lr=-1"))
    errs = info.value.errors
    assert [(e.path, e.line, e.column) for e in errs] == [
        ("f.restopo", 1, 49), ("<--set 1>", 1, 13), ("<--set 2>", 1, 16)]
    assert errs[1].source_line == "--set model.dpeth=3" and errs[1].hint == "did you mean 'depth'?"
    assert "3 errors" in str(info.value)


def test_several_errors_are_all_reported_in_source_order():
    text = ("model { vocab: 1; width: 64; depth: 4; heads: 3; context: 64 }\n"
            "residual full_attnres(gate: tanh, key_norm: l2)\n"
            "train { steps: 0; schedule: linear }\n"
            "parallel { pipeline(stages: 0) }\n")
    with pytest.raises(SpecErrors) as info:
        parse_spec(text)
    got = [(e.line, e.column) for e in info.value.errors]
    assert got == sorted(got) and len(got) == 7
    assert isinstance(info.value, SpecError)


def test_spec_error_render_and_pickle():
    e = SpecError("a.restopo", 2, 5, "bad thing", "do this", "abcdefg")
    assert str(e) == "a.restopo:2:5: error: bad thing\n    abcdefg\n        ^\nhint: do this"
    assert e.render("x\n\tzzz\n").splitlines()[1] == "     zzz"
    back = pickle.loads(pickle.dumps(e))
    assert (back.path, back.line, back.column, back.message, back.hint) == (
        "a.restopo", 2, 5, "bad thing", "do this")
    many = pickle.loads(pickle.dumps(SpecErrors([e, e])))
    assert len(many.errors) == 2
    assert restopo.SpecError is SpecError


def test_spec_error_helper_for_later_stages():
    spec = load_spec(EXAMPLES / "tiny.restopo")
    e = spec.error("train", "data", "cannot read the corpus", "check the path")
    assert e.path.endswith("tiny.restopo") and e.line == 14
    assert "data: builtin:stdlib" in e.source_line


def test_no_code_is_executed():
    """Values are matched against fixed vocabularies; nothing reaches eval."""
    with pytest.raises(SpecError):
        parse_spec('model { vocab: __import__("os").system("true") }\nresidual standard')
    with pytest.raises(SpecError):
        parse_spec("residual standard\ntrain { data: \"x\" + \"y\" }")


def test_every_example_checks_and_builds():
    files = sorted(EXAMPLES.glob("*.restopo"))
    assert len(files) >= 16
    for f in files:
        spec = load_spec(f)
        text = f.read_text()
        assert text.startswith("#"), f"{f.name} must begin with a comment saying what it tests"
        g = spec.ir()
        assert g.n_sublayers == len(spec.model.kinds)


def test_examples_have_the_paper_settings():
    def load(name):
        return load_spec(EXAMPLES / f"{name}.restopo")
    assert len(load("block_attnres").topology.blocks) == 8
    assert load("block_heads16").topology.sublayer_rule.heads == 16
    assert load("block_no_key_norm").topology.sublayer_rule.key_norm == "none"
    assert load("full_sigmoid").topology.sublayer_rule.gate == "sigmoid"
    assert load("full_no_key_norm").topology.sublayer_rule.key_norm == "none"
    assert load("full_input_dependent").topology.sublayer_rule.query == "input_dependent"
    assert load("full_window8").topology.sublayer_rule.sources == (Source("embedding"),
                                                                   Source("window", 8))
    dense, scalars = load("denseformer").topology, load("full_scalars").topology
    assert dense.sublayer_rule.method == scalars.sublayer_rule.method == "scalars"
    assert dense.sublayer_rule.gate == dense.head_rule.gate == "none"        # init 1, sum
    assert scalars.sublayer_rule.gate == scalars.head_rule.gate == "softmax"  # init 0, mean
    assert scalars.sublayer_rule.sources == dense.sublayer_rule.sources
    for name in ("rezero", "layerscale", "highway"):
        assert load(name).topology.sublayer_rule.method == name
    tiny = load("tiny")
    assert (tiny.model.vocab, tiny.model.width, tiny.model.depth, tiny.model.heads,
            tiny.model.context, tiny.train.batch) == (256, 64, 4, 4, 64, 16)


@pytest.mark.parametrize("value", ["1e400", "1" + "0" * 60, "9" * 5000, "-" + "9" * 5000,
                                   "3000000000"])
def test_huge_numbers_are_spec_errors(value):
    text = ("model { vocab: 256; width: 64; depth: 2; heads: 4; context: 64 }\n"
            f"residual full_attnres(window: {value})\ntrain {{ lr: {value} }}")
    with pytest.raises(SpecErrors) as info:
        parse_spec(text)
    assert [e.line for e in info.value.errors] == [2, 3]


def test_crlf_tabs_and_byte_order_mark(tmp_path):
    p = tmp_path / "w.restopo"
    text = "model {\r\n\tvocab: 256\r\n\twidth: 64; depth: 2\r\n\theads: 4; context: 8\r\n}\r\n" \
           "residual block_attnres(blocks: 2)\r\n"
    p.write_bytes(b"\xef\xbb\xbf" + text.encode())
    spec = load_spec(p)
    assert spec.model.depth == 2 and spec.residual.blocks == 2


def test_named_topology_with_braces():
    a = parse_spec("model { vocab: 256; width: 64; depth: 4; heads: 4; context: 8 }\n"
                   "residual block_attnres {\n  blocks: 2\n  key_norm: none\n}")
    b = parse_spec("model { vocab: 256; width: 64; depth: 4; heads: 4; context: 8 }\n"
                   "residual block_attnres(blocks: 2, key_norm: none)")
    assert a.residual == b.residual and a.topology == b.topology


def test_data_override_takes_a_bare_path():
    base = EXAMPLES / "tiny.restopo"
    assert load_spec(base, ("train.data=data/corpus.txt",)).train.data == "data/corpus.txt"
    assert load_spec(base, ('train.data="a b.txt"',)).train.data == "a b.txt"
    assert load_spec(base, ("train.data=builtin:stdlib",)).train.data == "builtin:stdlib"
    spec = load_spec(base, ("train.data=corpus",))
    assert spec.train.data == "corpus" and spec.train.where("data").source == "<--set 1>"
    with pytest.raises(SpecError, match="did you mean 'builtin:stdlib'"):
        load_spec(base, ("train.data=stdlib",))


def test_shortening_steps_on_the_command_line_keeps_the_files_warmup():
    text = ("model m { vocab: 256; width: 32; depth: 2; heads: 4; context: 32 }\n"
            "residual standard\ntrain { steps: 300; warmup: 30 }\n")
    spec = parse_spec(text, "m.restopo", overrides=("train.steps=10",))
    assert (spec.train.steps, spec.train.warmup) == (10, 30)
    with pytest.raises(SpecError, match=r"warmup \(30\) is longer than steps \(10\)"):
        parse_spec(text.replace("steps: 300", "steps: 10"), "m.restopo")
