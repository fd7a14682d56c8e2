"""restopo.compile / restopo.aggregations and `restopo compile -o model.py|model.pt`."""
import ast
import os
import subprocess
import sys

import pytest
import torch
from file_modules import load_file

import restopo
from restopo.nn.aggregate import Attend
from restopo.spec import SpecError, parse_spec

TEXT = """
model t { vocab: 61; width: 32; depth: 3; heads: 4; context: 16; mlp: swiglu(2x) }
residual block_attnres(blocks: 2)
train { seed: 3 }
"""


def test_compile_from_text_path_and_spec(tmp_path):
    path = tmp_path / "t.restopo"
    path.write_text(TEXT)
    idx = torch.randint(0, 61, (2, 5))
    for source in (TEXT, str(path), path, parse_spec(TEXT)):
        torch.manual_seed(0)
        model = restopo.compile(source, backend="eager")
        assert isinstance(model, torch.fx.GraphModule)
        assert model(idx).shape == (2, 5, 61)
        assert model.spec_text == TEXT
    assert restopo.compile(path, overrides=("model.width=16",)).embed.weight.shape == (61, 16)


def test_compile_rejects_bad_specs_clearly(tmp_path):
    with pytest.raises(SpecError):
        restopo.compile(TEXT.replace("blocks: 2", "blocks: 7"))
    with pytest.raises(FileNotFoundError):
        restopo.compile(str(tmp_path / "missing.restopo"))
    with pytest.raises(ValueError, match="unknown backend"):
        restopo.compile(TEXT, backend="cuda")
    with pytest.raises(TypeError):
        restopo.compile(42)


def test_triton_backend_error_names_why(monkeypatch):
    from restopo import ops
    why = "no CUDA device and TRITON_INTERPRET is not set to 1"
    monkeypatch.setattr(ops, "triton_unavailable_reason", lambda device=None: why)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        restopo.compile(TEXT, backend="triton")


def test_api_mistakes_are_named():
    """One override given as a string is one override (it was split into characters, each
    a bad --set); token ids without a batch dimension, and an out-of-range seed, are said
    in words rather than an IndexError or torch's overflow."""
    text = "model t { vocab: 32; width: 16; depth: 2; heads: 2; context: 8 }\nresidual standard\n"
    m = restopo.compile(text, overrides="model.width=24")
    assert m.restopo_overrides == ("model.width=24",) and m.embed.weight.shape == (32, 24)
    with pytest.raises(ValueError, match=r"token ids \[batch, T\]; got shape \(3,\)"):
        m(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="seed must be a 64-bit number"):
        m.generate(torch.tensor([[1, 2]]), 2, seed=2 ** 70)
    # init of the wrong kind failed late, as "'int' object has no attribute 'unit'"
    with pytest.raises(TypeError, match=r"init takes a restopo.nn.init.Init .*not int 3"):
        restopo.compile(text, init=3)


def test_token_ids_outside_the_vocabulary_are_named_eager_and_compiled():
    """An id >= vocab (or < 0) failed inside the embedding: an IndexError eagerly, an
    inductor 'index out of bounds' compiled, a device assert on CUDA. Every form of the
    model now names the id and the vocabulary, with or without autograd; torch.compile
    (the whole model, one region) keeps the check in its graph and does not break it."""
    text = "model t { vocab: 32; width: 16; depth: 1; heads: 2; context: 8 }\nresidual standard\n"
    eager = restopo.compile(text, backend="eager")
    regional = restopo.compile(text, backend="eager")
    regional.embed.compile(backend="aot_eager")
    whole = torch.compile(restopo.compile(text, backend="eager"), backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for model in (eager, regional, whole):
        assert model(torch.tensor([[0, 31]])).shape == (1, 2, 32)
        for bad in (32, 1000, -1):
            for grad in (True, False):
                with torch.set_grad_enabled(grad), pytest.raises(
                        ValueError, match=f"^token id {bad}, outside the model's vocabulary "
                                          f"0..31$"):
                    model(torch.tensor([[3, bad]]))
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_load_onto_cuda_without_cuda_says_so(tmp_path):
    """torch's own was an AssertionError from deep in the load."""
    path = tmp_path / "m.safetensors"
    restopo.export(restopo.compile(TEXT), path)
    with pytest.raises(restopo.saved.LoadError, match="torch sees no CUDA device here; "
                       "load with device='cpu'"):
        restopo.load(path, device="cuda")


def test_load_takes_every_spelling_of_the_cpu_device_torch_takes(tmp_path):
    """safetensors refused device='cpu:0' ("device cpu:0 is invalid"), which torch takes."""
    model = restopo.compile(TEXT)
    path = tmp_path / "m.safetensors"
    restopo.export(model, path)
    idx = torch.randint(0, 61, (1, 4))
    for device in ("cpu:0", torch.device("cpu", 0), "cpu"):
        torch.testing.assert_close(restopo.load(path, device=device)(idx), model.eval()(idx),
                                   rtol=0, atol=0)


def test_aggregations_in_execution_order_head_last():
    model = restopo.compile(TEXT)
    aggs = restopo.aggregations(model)
    assert len(aggs) == 2 * 3 + 1 and aggs == list(model.aggregations)
    assert all(isinstance(a, Attend) for a in aggs)
    for a in aggs:
        assert isinstance(a.pseudo_query, torch.nn.Parameter) and a.pseudo_query.shape == (32,)
        assert isinstance(a.key_norm, torch.nn.RMSNorm)
    # setting a query changes the model: aggregations are live handles, not copies
    idx = torch.randint(0, 61, (1, 4))
    before = model(idx)
    with torch.no_grad():
        aggs[-1].pseudo_query.normal_()
    assert not torch.allclose(before, model(idx))


def test_direct_calls_each_point_on_its_sources_and_computes_the_same_model():
    """restopo.direct: the model without the two-phase plan, sharing its modules, so that a
    pre-hook on an aggregation sees every source and reads its depth-attention weights."""
    model = restopo.compile(TEXT).double()
    seen = restopo.direct(model)
    idx = torch.randint(0, 61, (2, 5))
    torch.testing.assert_close(seen(idx), model(idx), rtol=1e-12, atol=1e-12)
    weights = []
    hooks = [a.register_forward_pre_hook(lambda m, srcs: weights.append(
        (m, m.depth_weights(*srcs)))) for a in restopo.aggregations(seen)]
    seen(idx)
    for h in hooks:
        h.remove()
    assert [m for m, _ in weights] == restopo.aggregations(model)  # each point once, in order
    for m, w in weights:
        torch.testing.assert_close(w.sum(0), torch.ones_like(w[0]))
    assert restopo.direct(model).get_parameter("aggregations.0.pseudo_query") is \
        model.get_parameter("aggregations.0.pseudo_query")


def test_aggregations_rejects_foreign_modules():
    with pytest.raises(ValueError, match="not built by restopo"):
        restopo.aggregations(torch.nn.Linear(2, 2))


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "restopo", "compile", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_model_py_round_trip(tmp_path):
    (tmp_path / "t.restopo").write_text(TEXT)
    r = _cli("t.restopo", "-o", "gen_model.py", "--set", "model.depth=2", "--backend", "eager",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    source = (tmp_path / "gen_model.py").read_text()
    imported = {a.name.split(".")[0] for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "collections", "types", "torch"}  # standalone
    assert "def forward(self, idx):" in source and "block1 = " in source
    mod = load_file(tmp_path / "gen_model.py", "gen_model")
    built = mod.build()
    # the file holds the eager backend's code: against the eager backend, the same bits
    ref = restopo.compile(tmp_path / "t.restopo", overrides=("model.depth=2",), backend="eager")
    with torch.no_grad():
        for a in restopo.aggregations(ref):
            a.pseudo_query.normal_()
    built.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 61, (2, 6))
    with torch.no_grad():  # the same ops, so the same bits
        torch.testing.assert_close(built(idx), ref(idx), rtol=0, atol=0)
    # the default backend on the CPU (the fused C kernels where they build): rounding
    auto = restopo.compile(tmp_path / "t.restopo", overrides=("model.depth=2",))
    auto.load_state_dict(ref.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(built(idx), auto(idx), rtol=1e-5, atol=1e-6)
    # With autograd the model shares each source's logits among its readers (one matmul,
    # restopo.nn.shared_sources) where the file's model makes each reader's own: the same
    # mathematics, rounded differently in float32.
    torch.testing.assert_close(built(idx), ref(idx), rtol=1e-5, atol=1e-6)
    assert len(built.aggregations) == 5


def test_cli_model_pt_round_trip(tmp_path):
    (tmp_path / "t.restopo").write_text(TEXT)
    r = _cli("t.restopo", "-o", "m.pt", "--set", "model.width=16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    blob = torch.load(tmp_path / "m.pt", weights_only=True)
    assert blob["spec"] == TEXT and blob["overrides"] == ["model.width=16"]
    model = restopo.compile(blob["spec"], overrides=blob["overrides"])
    model.load_state_dict(blob["state_dict"])
    assert model.embed.weight.shape == (61, 16)
    torch.testing.assert_close(model.embed.weight, blob["state_dict"]["embed.weight"])
    assert not any(p.name.startswith(".restopo-") for p in tmp_path.iterdir())


def test_cli_errors(tmp_path):
    (tmp_path / "t.restopo").write_text(TEXT)
    r = _cli("t.restopo", "-o", "m.txt", cwd=tmp_path)
    assert r.returncode == 2 and "must end in .py or .pt" in r.stderr
    r = _cli("t.restopo", "-o", "m.pt", "--set", "model.heads=5", cwd=tmp_path)
    assert r.returncode == 1 and "heads" in r.stderr and "Traceback" not in r.stderr
    r = _cli("missing.restopo", "-o", "m.pt", cwd=tmp_path)
    assert r.returncode == 1 and "missing.restopo" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m.pt").exists()


def test_deepcopy_and_pickle_keep_two_phase_members_linked():
    import copy
    model = restopo.compile(TEXT)
    for clone in (copy.deepcopy(model), _pickled(model)):
        assert clone.phases[0].members[0] is clone.aggregations[0]
        with torch.no_grad():
            clone.aggregations[1].pseudo_query.normal_()
        idx = torch.randint(0, 61, (1, 4))
        assert not torch.allclose(clone(idx), model(idx))  # the clone's own parameters


def _pickled(model):
    import io
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _held_at_aggregations(gm, idx, d) -> int:
    """The most d-vectors per token the compiled model holds at an aggregation module's call:
    every tensor of the last axis d made before the call and read at it or later (read off
    the fx graph and the tensors one forward makes; views of one tensor counted apart)."""
    made = {}

    def tensors(x):
        if isinstance(x, (tuple, list)):
            return [t for y in x for t in tensors(y)]
        return [x] if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[-1] == d else []

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            made[n] = tensors(out)
            return out

    with torch.no_grad():
        Record(gm).run(idx)
    nodes = list(gm.graph.nodes)
    last = {n: max([nodes.index(u) for u in n.users] or [i]) for i, n in enumerate(nodes)}
    peak = 0
    for k, n in enumerate(nodes):
        if n.op == "call_module" and n.target.startswith("aggregations"):
            held = {t.data_ptr(): t.numel() // idx.numel() // d
                    for m in nodes[:k] if last[m] >= k for t in made[m]}
            peak = max(peak, sum(held.values()))
    return peak


@pytest.mark.parametrize("depth,blocks", [(4, 2), (6, 3), (6, 2), (3, 1)])
def test_live_values_are_what_the_model_holds_two_phase_or_direct(depth, blocks):
    """Block AttnRes's phase 1 makes one result per sublayer of its block and the model
    holds them all until the block's last merge: inspect said N + 1 live values (the
    sources), where the model as compiled holds up to N + S (7, not 3, for 2 blocks of 4)."""
    from restopo.ir.summary import summary
    spec = parse_spec(TEXT.replace("depth: 3", f"depth: {depth}")
                      .replace("blocks: 2", f"blocks: {blocks}"))
    model = restopo.compile(spec, backend="eager")
    idx = torch.randint(0, 61, (1, 4))
    report = summary(spec.ir())
    assert report["live_values_two_phase"] == _held_at_aggregations(model, idx, 32)
    direct = restopo.api.direct(model)  # the same points, each on all its sources
    assert report["live_values_per_token"] == _held_at_aggregations(direct, idx, 32)
