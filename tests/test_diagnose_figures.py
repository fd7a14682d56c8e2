"""`restopo diagnose`: the figures are written, and the depth weights it reports are right.

The weights are recomputed from each aggregation's parameters over its IR sources; the check
that holds them is independent of that code: sum_i w_i v_i must equal the h_l the model
itself fed to sublayer l (captured by a hook), token by token.
"""
import json

import pytest
import torch

from restopo import topology as T
from restopo.api import aggregations, build_model
from restopo.cli import main
from restopo.ir import build_ir
from restopo.spec.objects import ModelSpec
from restopo.train.diagnose import collect, depth_weights

M = ModelSpec(vocab=256, width=32, depth=3, heads=4, context=16)

SPEC = """\
model t { vocab: 256; width: 32; depth: 2; heads: 4; context: 32 }
residual RESIDUAL
train { data: builtin:stdlib; steps: 4; batch: 4; warmup: 1; eval_every: 4; eval_batches: 1
        save_every: 4; log_every: 1 }
"""


def batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (2, 16), generator=g),
             torch.randint(0, 256, (2, 16), generator=g)) for _ in range(n)]


def randomised(top, seed=0):
    torch.manual_seed(seed)
    model = build_model(M, top, backend="eager")
    with torch.no_grad():  # trained-looking parameters: queries, gains, scalars, gates
        for agg in aggregations(model):
            for p in agg.parameters():
                p.add_(torch.randn_like(p) * 0.7)
    return model


TOPOLOGIES = {
    "standard": T.standard(M.kinds),
    "full": T.full_attnres(M.kinds),
    "block": T.block_attnres(M.kinds, blocks=2),
    "block_size4": T.block_attnres(M.kinds, block_size=4),
    "full_sigmoid_heads": T.full_attnres(M.kinds, gate="sigmoid", heads=4),
    "full_input_dependent": T.full_attnres(M.kinds, query="input_dependent"),
    "full_no_key_norm": T.full_attnres(M.kinds, key_norm="none"),
    "denseformer": T.denseformer(M.kinds),
    "full_scalars_softmax": T.denseformer(M.kinds, gate="softmax"),
    "full_scalars_sigmoid": T.denseformer(M.kinds, gate="sigmoid"),
    "rezero": T.rezero(M.kinds),
    "layerscale": T.layerscale(M.kinds),
    "highway": T.highway(M.kinds),
    "mhc": T.mhc(M.kinds, 4),
    "dhc": T.hyper_connections(M.kinds, 3, dynamic=True),
    "mhc_lite": T.mhc_lite(M.kinds, 3),
}


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_weights_reconstruct_every_aggregation(name):
    top = TOPOLOGIES[name]
    numbers = collect(randomised(top), build_ir(M.kinds, top, M.width), batches(),
                      torch.device("cpu"))
    assert numbers["reconstruction_error"] < 1e-4
    aggs = numbers["aggregations"]
    assert [a["index"] for a in aggs] == list(range(1, M.depth * 2 + 2))
    if top.sublayer_rule.gate == "softmax" and top.sublayer_rule.method in ("attend", "scalars"):
        for a in aggs:  # a softmax's mean weights still sum to one
            assert sum(a["weights"]) == pytest.approx(1.0, abs=1e-5)
    if name == "standard":
        assert all(w == 1.0 for a in aggs for w in a["weights"])
    assert len(numbers["output_rms"]) == len(numbers["param_grad_norm"]) == 2 * M.depth
    assert all(g > 0 for g in numbers["param_grad_norm"])
    assert len(numbers["input_rms"]) == 2 * M.depth + 1
    if top.sublayer_rule.multi_stream:  # the mean coefficients of every sublayer
        n = top.sublayer_rule.streams
        coeffs = numbers["stream_coefficients"]
        assert len(coeffs) == 2 * M.depth
        assert all(len(c["pre"]) == len(c["post"]) == n and len(c["res"]) == n for c in coeffs)
        if name != "dhc":  # mHC and mHC-lite mix with (nearly) doubly stochastic H^res
            assert all(sum(row) == pytest.approx(1, abs=1e-5) for c in coeffs for row in c["res"])


def test_fresh_attnres_is_the_plain_mean():
    top = TOPOLOGIES["block"]
    torch.manual_seed(0)
    model = build_model(M, top, backend="eager")  # zero pseudo-queries
    numbers = collect(model, build_ir(M.kinds, top, M.width), batches(1), torch.device("cpu"))
    for a in numbers["aggregations"]:
        n = len(a["sources"])
        assert a["weights"] == pytest.approx([1 / n] * n, abs=1e-6)


def test_fresh_scalars_weights_follow_the_gate():
    """Fresh softmax scalars weigh every source 1/n (the plain mean); DenseFormer's raw
    scalars weigh each 1 (the sum): the recomputed weights read the IR's gate."""
    for gate, want in (("softmax", lambda n: [1 / n] * n), ("none", lambda n: [1.0] * n)):
        top = T.denseformer(M.kinds, gate=gate)
        torch.manual_seed(0)
        model = build_model(M, top, backend="eager")
        numbers = collect(model, build_ir(M.kinds, top, M.width), batches(1),
                          torch.device("cpu"))
        assert numbers["reconstruction_error"] < 1e-4
        for a in numbers["aggregations"]:
            assert a["weights"] == pytest.approx(want(len(a["sources"])), abs=1e-6)


def _capture(model, idx):
    """One forward pass: every source v_0..v_L and every sublayer's and the head's input."""
    captured = {}
    subs = list(model.get_submodule("sublayers"))
    hooks = [model.get_submodule("embed").register_forward_hook(
        lambda m, a, o: captured.__setitem__(0, o))]
    for i, s in enumerate(subs, start=1):
        hooks.append(s.register_forward_pre_hook(
            lambda m, a, i=i: captured.__setitem__(("h", i), a[0])))
        hooks.append(s.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(i, o)))
    hooks.append(model.get_submodule("head").register_forward_pre_hook(
        lambda m, a: captured.__setitem__(("h", len(subs) + 1), a[0])))
    with torch.no_grad():
        model(idx)
    for hk in hooks:
        hk.remove()
    return ([captured[i] for i in range(len(subs) + 1)],
            [captured[("h", i)] for i in range(1, len(subs) + 2)])


def test_wrong_weights_would_be_caught():
    """The reconstruction check has teeth: perturb a query after the forward pass and the
    recomputed weights no longer rebuild the captured h."""
    top = TOPOLOGIES["full"]
    model = randomised(top)
    g = build_ir(M.kinds, top, M.width)
    v, h = _capture(model, batches(1)[0][0])
    with torch.no_grad():
        assert max(e for *_, e in depth_weights(g, aggregations(model), v, h)) < 1e-5
        aggregations(model)[3].pseudo_query.add_(1.0)
        assert max(e for *_, e in depth_weights(g, aggregations(model), v, h)) > 1e-3


def test_wrong_stream_coefficients_would_be_caught():
    """For n streams the weights come from re-running each point's coefficients on streams
    rebuilt from the captured outputs: after a change to one phi they no longer rebuild h."""
    top = TOPOLOGIES["mhc"]
    model = randomised(top)
    g = build_ir(M.kinds, top, M.width)
    numbers = collect(model, g, batches(1), torch.device("cpu"))
    assert numbers["reconstruction_error"] < 1e-4
    v, h = _capture(model, batches(1)[0][0])
    with torch.no_grad():
        assert max(e for *_, e in depth_weights(g, aggregations(model), v, h)) < 1e-4
        aggregations(model)[2].phi.add_(0.5)
        assert max(e for *_, e in depth_weights(g, aggregations(model), v, h)) > 1e-3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("restopo-cache")


@pytest.mark.parametrize("residual", ["block_attnres(blocks: 2)", "standard",
                                      "mhc(streams: 2)"])
def test_diagnose_command_writes_figures(tmp_path, monkeypatch, capsys, residual, cache):
    monkeypatch.setenv("RESTOPO_CACHE", str(cache))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # train's default: one thread
    spec = tmp_path / "t.restopo"
    spec.write_text(SPEC.replace("RESIDUAL", residual))
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(out), "--batches", "1", "--batch-size", "2"]) == 0
    printed = capsys.readouterr().out
    for name in ("magnitude.png", "gradients.png", "depth_attention.png"):
        png = out / "diagnose" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and name in printed
    numbers = json.loads((out / "diagnose" / "diagnose.json").read_text())
    assert numbers["step"] == 4 and numbers["reconstruction_error"] < 1e-4
    written = [p.name for p in (out / "diagnose").iterdir()]
    assert main(["diagnose", "--help"]) == 0  # names each (it left hyper_connections.png out)
    helped = capsys.readouterr().out
    assert not [name for name in written if name not in helped], written
    if residual.startswith("mhc"):  # the H^pre/H^post/H^res heatmaps; step 0 is O(alpha) off
        png = out / "diagnose" / "hyper_connections.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "hyper_connections" in printed
        assert not numbers["step0"]["expected_equal"] and numbers["step0"]["difference"] < 1e-2
        return
    # both start as the standard residual, and the report says so
    assert "step 0: equals the standard residual" in printed
    assert numbers["step0"]["expected_equal"] and numbers["step0"]["difference"] < 1e-5


def test_diagnose_bad_checkpoint(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "missing: no such file or folder" in err and "Traceback" not in err
    assert main(["diagnose", str(tmp_path)]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


def test_step0_line_flags_a_broken_start_and_names_the_expected_ones(monkeypatch):
    """The report line tells apart: equal as it should, different though it should not be
    (here: every norm's epsilon put back to 1e-6, the trap restopo.nn.norm avoids), and
    different as expected (ReZero starts with the sublayers switched off)."""
    import restopo.nn.aggregate as aggregate
    import restopo.nn.sublayers as sublayers
    from restopo.train.init_check import step0_report

    m = ModelSpec(vocab=256, width=32, depth=16, heads=4, context=16)
    idx = batches(1)[0][0]
    full = T.full_attnres(m.kinds)
    line = step0_report(m, full, build_ir(m.kinds, full), idx)["line"]
    assert line.startswith("step 0: equals the standard residual")
    rezero = T.rezero(m.kinds)
    report = step0_report(m, rezero, build_ir(m.kinds, rezero), idx)
    assert not report["expected_equal"] and "as expected" in report["line"]
    assert "does not weigh every earlier output alike" in report["line"]
    # mHC weighs its sources alike too: it is its random phi that it differs by
    mhc = T.mhc(m.kinds, streams=2)
    report = step0_report(m, mhc, build_ir(m.kinds, mhc), idx)
    assert not report["expected_equal"] and "mhc's small random phi" in report["line"]
    monkeypatch.setattr(sublayers, "NORM_EPS", 1e-6)  # read when the norms are built
    monkeypatch.setattr(aggregate, "EPS", 1e-6)
    report = step0_report(m, full, build_ir(m.kinds, full), idx)
    assert report["line"].startswith("step 0: DIFFERS from the standard residual")
    assert report["difference"] > 1e-2


def test_a_streams_figure_of_the_diagnose_before_is_removed(tmp_path, monkeypatch, capsys,
                                                             cache):
    """diagnose of an mhc run, then of a standard one into the same --out, left the first
    one's hyper_connections.png beside the second's figures, as if of its model. A
    hyper_connections.png no diagnose wrote there is left alone."""
    monkeypatch.setenv("RESTOPO_CACHE", str(cache))
    figures = tmp_path / "figures"
    runs = {}
    for residual in ("mhc(streams: 2)", "standard"):
        spec = tmp_path / f"{residual[:3]}.restopo"
        spec.write_text(SPEC.replace("RESIDUAL", residual))
        runs[residual] = tmp_path / residual[:3]
        assert main(["train", str(spec), "--out", str(runs[residual]), "--no-progress"]) == 0
    argv = ["--batches", "1", "--batch-size", "2", "--out", str(figures)]
    assert main(["diagnose", str(runs["mhc(streams: 2)"]), *argv]) == 0
    assert (figures / "hyper_connections.png").exists()
    assert main(["diagnose", str(runs["standard"]), *argv]) == 0
    assert not (figures / "hyper_connections.png").exists()
    (figures / "hyper_connections.png").write_bytes(b"mine")
    assert main(["diagnose", str(runs["standard"]), *argv]) == 0
    assert (figures / "hyper_connections.png").read_bytes() == b"mine"
    capsys.readouterr()
