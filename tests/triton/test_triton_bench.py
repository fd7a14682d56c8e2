"""bench/triton_depth.py: without a GPU it says so and exits 0. (Its --dry-run, every case
and arm on tiny shapes under the interpreter, runs inside bench/gpu_check.sh's dry run:
test_gpu_check_dry_run.py.)"""
import pytest
import torch
from file_modules import bench


def _bench():
    return bench("triton_depth")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_gpu_it_says_so(capsys):
    assert _bench().main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_peers_that_do_not_import_say_why():
    arms = _bench().peer_arms(1e-30)
    assert [name for name, _, _ in arms] == ["peer fast-attnres", "peer fla-core",
                                            "peer flash-attn-res"]
    for name, fn, why in arms:
        assert (fn is None) == (why is not None), name


def _fake_package(root, name, source):
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(source)


def test_a_peer_that_breaks_at_import_is_left_out_with_its_error(tmp_path, monkeypatch):
    # flash-attn-res 0.1.12 raises ValueError at import under triton 3.9 (an autotune key
    # that names no kernel argument): one broken peer must not stop the benchmark
    _fake_package(tmp_path, "flash_attn_res", "raise ValueError('key names no argument')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "flash_attn_res", raising=False)
    arms = {name: (fn, why) for name, fn, why in _bench().peer_arms(1e-6)}
    fn, why = arms["peer flash-attn-res"]
    assert fn is None and "ValueError: key names no argument" in why


def test_peer_adapters_call_the_documented_entry_points(tmp_path, monkeypatch):
    # stand-ins with the peers' signatures (fast-attnres 2.1.0, flash-attn-res 0.1.12) that
    # check what they are handed and compute the aggregation in float64
    ref = ("import torch\n"
           "def agg(srcs, q, eps):\n"
           "    v = torch.stack([s.double() for s in srcs])\n"
           "    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)\n"
           "    return (torch.softmax(k @ q.double(), 0).unsqueeze(-1) * v).sum(0)\n")
    _fake_package(tmp_path, "attnres", ref + (
        "def attnres(values, query, *, eps=2**-23, scale=1.0):\n"
        "    assert isinstance(values, list) and query.ndim == 1\n"
        "    assert query.dtype == values[0].dtype, 'query must use the sources dtype'\n"
        "    return agg(values, query, eps).to(values[0].dtype)\n"))
    _fake_package(tmp_path, "flash_attn_res", ref + (
        "def phase_1_batched_attention_triton_op(blocks, queries, eps):\n"
        "    S, B, T, D = blocks.shape\n"
        "    assert queries.shape[1] == D and queries.dtype == blocks.dtype\n"
        "    out = torch.stack([agg(list(blocks), q, eps) for q in queries])\n"
        "    return out.to(torch.bfloat16), torch.zeros(len(queries), B, T)\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("attnres", "flash_attn_res"):
        monkeypatch.delitem(__import__("sys").modules, mod, raising=False)
    eps = 1e-6
    arms = {name: fn for name, fn, _ in _bench().peer_arms(eps)}
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 3, 8, generator=gen).bfloat16() for _ in range(4)]  # as a GPU
    query = torch.randn(8, generator=gen)
    want = torch.softmax(torch.stack([
        (s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + eps)) @
        query.double() for s in sources]), 0)
    want = (want.unsqueeze(-1) * torch.stack([s.double() for s in sources])).sum(0)
    for name in ("peer fast-attnres", "peer flash-attn-res"):
        got = arms[name](sources, query, None)
        assert got.shape == sources[0].shape and got.dtype == sources[0].dtype, name
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2, msg=name)


def test_an_arm_that_leaves_an_input_unused_is_timed():
    # fast-attnres takes no key-norm gain: its arm failed with "One of the differentiated
    # Tensors appears to not have been used in the graph" on an H200
    b = _bench()
    bench = b.Bench(b.parse_args(["--dry-run", "--peers", "none"]))
    x, gain = (torch.randn(3, 4, requires_grad=True) for _ in range(2))
    bench.fwd_bwd(lambda x, gain: x * 2, [x, gain])()
