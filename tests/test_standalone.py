"""`restopo compile -o model.py` is standalone: the file runs in a fresh interpreter that
cannot import restopo at all, and with the `-o model.pt` weights loaded strictly it computes
what restopo's compiled model computes."""
import ast
import builtins
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import restopo

MODEL = "model m { vocab: 61; width: 16; depth: 3; heads: 2; context: 16 }\n"
TOPOLOGIES = ["standard", "full_attnres", "block_attnres(blocks: 2)",
              "block_attnres(blocks: 2, query: input_dependent, gate: sigmoid, heads: 2)",
              "full_attnres(window: 2)", "rezero", "layerscale", "highway", "denseformer",
              "denseformer(gate: softmax)", "block_attnres(blocks: 3, key_norm: none)",
              "hyper_connections(streams: 2, dynamic: true)", "mhc(streams: 2, sinkhorn: 4)",
              "mhc_lite(streams: 3)"]

# Runs in the subprocess: restopo cannot be imported (a finder refuses it); each module is
# built, loaded strictly from its .pt, run on the given tokens, and the logits come back.
RUNNER = textwrap.dedent("""
    import importlib, importlib.abc, json, sys

    class NoRestopo(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "restopo":
                raise ImportError("restopo must not be imported by a standalone model.py")

    sys.meta_path.insert(0, NoRestopo())
    import torch
    idx = torch.tensor(json.loads(sys.argv[1]))
    out = {}
    for name in sys.argv[2:]:
        module = importlib.import_module(name)
        model = module.build().double()
        state = torch.load(name + ".pt", weights_only=True)["state_dict"]
        model.load_state_dict(state, strict=True)
        with torch.no_grad():  # the eager backend's no-grad (stacked) forms
            no_grad = model(idx).tolist()
        out[name] = {"logits": no_grad, "grad": model(idx).tolist(), "spec": module.SPEC}
    assert not [m for m in sys.modules if m.split(".")[0] == "restopo"]
    print(json.dumps(out))
""")


def compile_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "restopo", "compile", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def imported_roots(source: str) -> set[str]:
    tree = ast.parse(source)
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    return roots | {n.module.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom)}


def unbound_classes(source: str) -> set[str]:
    """Capitalised names the module reads but neither defines nor imports: a class that the
    writer referred to without writing it (pyflakes' undefined name, for the case that
    matters here; a line that never runs would hide it from the run below)."""
    tree = ast.parse(source)
    bound = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    bound |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
              and not isinstance(n.ctx, ast.Load)}  # any assignment, coarse on purpose
    bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.posonlyargs + n.args + n.kwonlyargs}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load) and n.id[:1].isupper()}
    return read - bound - set(dir(builtins))


def test_standalone_modules_run_without_restopo(tmp_path):
    from restopo.commands.standalone import module_source
    idx = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    want, names = {}, []
    for k, topology in enumerate(TOPOLOGIES):
        text = MODEL + f"residual {topology}\n"
        name = f"gen_model_{k}"
        torch.manual_seed(k)
        ref = restopo.compile(text).double()
        with torch.no_grad():  # trained-looking weights, saved as restopo compile -o .pt
            for p in ref.parameters():
                p.add_(0.1 * torch.randn_like(p))
            want[name] = (text, ref(idx))
        torch.save({"spec": text, "overrides": [], "state_dict": ref.state_dict()},
                   tmp_path / f"{name}.pt")
        source = module_source(ref, name, "t.restopo")
        assert imported_roots(source) <= {"__future__", "math", "collections", "contextlib",
                                          "itertools", "types", "torch"}
        assert not unbound_classes(source), (topology, unbound_classes(source))
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(idx.tolist()), *names],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    for name, topology in zip(names, TOPOLOGIES):
        text, logits = want[name]
        assert got[name]["spec"] == text
        for key in ("logits", "grad"):  # without and with autograd: both forms
            torch.testing.assert_close(torch.tensor(got[name][key], dtype=torch.float64),
                                       logits, rtol=1e-12, atol=1e-12, msg=topology)


def test_compile_cli_writes_the_standalone_module(tmp_path):
    text = MODEL + "residual block_attnres(blocks: 2)\n"
    (tmp_path / "t.restopo").write_text(text)
    for out in ("gen_model.py", "m.pt"):
        r = compile_cli("t.restopo", "-o", out, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    source = (tmp_path / "gen_model.py").read_text()
    assert imported_roots(source) <= {"__future__", "math", "collections", "types", "torch"}
    run = subprocess.run([sys.executable, "-c", RUNNER.replace('name + ".pt"', '"m.pt"'),
                          "[[1, 2, 3]]", "gen_model"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["gen_model"]["spec"] == text


@pytest.mark.parametrize("name", ["m", "model", "a_rather_long_module_name"])
def test_the_docstrings_example_keeps_its_comments_in_one_column(name):
    """The example's comments were aligned for the template's '{name}': off by the name's
    length less six for every real name ('model = tiny_model.build()   ' pushed its
    comment two columns right of the others)."""
    from restopo.commands.standalone import module_source
    model = restopo.compile(MODEL + "residual standard\n", backend="eager")
    doc = ast.get_docstring(ast.parse(module_source(model, name, "t.restopo")))
    example = [ln for ln in doc.splitlines() if ln.startswith("    ")][:5]
    assert example[0] == f"    import torch, {name}" and f"{name}.build()" in example[1]
    assert len({ln.index("# ") for ln in example[1:]}) == 1, example


def test_spec_text_cannot_break_out_of_the_module(tmp_path):
    """Quotes, backslashes and triple quotes in the spec (comments) stay data."""
    text = ("# a ''' and a \"\"\" and a \\ and ends with a quote'\n" + MODEL
            + "residual standard  # \\\n")
    (tmp_path / "t.restopo").write_text(text)
    (tmp_path / "odd'\"name.restopo").write_text(text)
    for spec_file in ("t.restopo", "odd'\"name.restopo"):
        r = compile_cli(spec_file, "-o", "gen_model.py", "--overwrite", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        namespace = {}
        exec(compile((tmp_path / "gen_model.py").read_text(), "gen_model.py", "exec"), namespace)
        assert namespace["SPEC"] == text


@pytest.mark.parametrize("topology", ["full_attnres", "block_attnres(blocks: 2)"])
def test_the_bit_for_bit_promise_is_the_one_that_holds(tmp_path, monkeypatch, topology):
    """The module's docstring promises restopo.load(..., backend="eager")'s outputs bit for
    bit without autograd, and only that: with autograd on, restopo's eager backend shares
    each source's logits across its readers (one matmul), which rounds differently."""
    import importlib
    from restopo.commands.standalone import module_source
    torch.manual_seed(0)
    ref = restopo.compile(MODEL + f"residual {topology}\n", backend="eager").eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
    source = module_source(ref, "bitwise_model", "t.restopo")
    (tmp_path / "bitwise_model.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("bitwise_model")
    try:
        model = module.build()
        model.load_state_dict(ref.state_dict(), strict=True)
        model.eval()
        idx = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(model(idx), ref(idx))  # the promise: bit for bit
        torch.testing.assert_close(model(idx), ref(idx))  # with autograd: up to rounding
        doc = " ".join(module.__doc__.split())
        claim = doc[doc.index("eager backend:"):doc.index("bit for bit") + len("bit for bit")]
        assert "without autograd" in claim, claim  # the doc says when it holds
    finally:
        sys.modules.pop("bitwise_model", None)


def test_a_token_id_outside_the_vocabulary_is_refused_as_restopo_refuses_it(tmp_path,
                                                                              monkeypatch):
    """model.py looked an id past the vocabulary up in nn.Embedding ('IndexError: index
    out of range in self', on a GPU a device assert); it names the id and the vocabulary in
    restopo's words, with autograd and without."""
    import importlib
    from restopo.commands.standalone import module_source
    ref = restopo.compile(MODEL + "residual block_attnres(blocks: 2)\n")
    (tmp_path / "vocab_model.py").write_text(module_source(ref, "vocab_model", "t.restopo"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        model = importlib.import_module("vocab_model").build()
        for bad in (61, -1):
            idx = torch.tensor([[1, bad, 2]])
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    with pytest.raises(ValueError) as want:
                        ref(idx)
                    with pytest.raises(ValueError) as got:
                        model(idx)
                assert str(got.value) == str(want.value) and str(bad) in str(got.value)
    finally:
        sys.modules.pop("vocab_model", None)


def test_the_vocabulary_check_leaves_a_compiled_forward_in_one_graph(tmp_path, monkeypatch):
    """The written file's id check reads the ids; traced by torch.compile that read broke the
    graph (restopo's own check is an opaque op). A compiled forward leaves it out, and is one
    graph with the model's logits."""
    import importlib
    from restopo.commands.standalone import module_source
    ref = restopo.compile(MODEL + "residual block_attnres(blocks: 2)\n", backend="eager")
    (tmp_path / "graph_model.py").write_text(module_source(ref, "graph_model", "t.restopo"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        model = importlib.import_module("graph_model").build()
        model.load_state_dict(ref.state_dict())
        idx = torch.tensor([[1, 5, 2]])
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(idx), ref(idx))
    finally:
        sys.modules.pop("graph_model", None)
        torch._dynamo.reset()
