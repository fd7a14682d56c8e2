"""Throughput figures: FLOPs per token of multi-stream points against torch's FLOP counter,
`restopo inspect`'s flops_per_token, and MFU in metrics.jsonl (restopo.train.throughput)."""
import json
import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from restopo.cli import main
from restopo.ir import Aggregation
from restopo.nn.flops import flops_per_token, stream_flops
from restopo.nn.streams import make_stream_module, write_streams
from restopo.nn.streams import sinkhorn as sinkhorn_iterations
from restopo.spec import load_spec
from restopo.train import throughput


def _counted(method: str, n: int, d: int, dynamic: bool) -> float:
    """Matmul FLOPs per token torch counts for one point: its module and the stream write."""
    module = make_stream_module(method, n, d, 3, False, dynamic=dynamic)
    x, v = torch.randn(2, 5, n, d), torch.randn(2, 5, d)
    with FlopCounterMode(display=False) as counter:
        h, post, res = module(x)
        write_streams(x, v, post, res)
    return counter.get_total_flops() / 10


@pytest.mark.parametrize("method,n,dynamic", [("hyper_connections", 4, False),
                                              ("hyper_connections", 4, True), ("mhc", 4, False),
                                              ("mhc_lite", 3, False)])
def test_stream_point_flops_match_torchs_counter(method, n, dynamic):
    """What the counter sees (matmuls) plus, by hand, what runs as products and sums (the
    read sum_i pre_i X_i, the write's post (x) v and its add: 2 n d each) and mHC's Sinkhorn
    iterations counted op by op is the formula, up to mHC-lite's n! x n x n mix."""
    def ours(d):
        a = Aggregation(index=3, before="attn", method=method, sources=("streams3",),
                        block=1, j=0, streams=n, dynamic=dynamic)
        return stream_flops(a, d)

    rest = [ours(d) - _counted(method, n, d, dynamic) - 4 * n * d for d in (16, 32)]
    assert rest[0] == rest[1]  # every term that grows with d agrees
    sinkhorn = _elementwise(lambda z: sinkhorn_iterations(z, 20), torch.randn(5, n, n)) / 5 \
        if method == "mhc" else 0
    assert abs(rest[0] - sinkhorn) <= 2 * math.factorial(n) * n * n  # mHC-lite's counted mix


class _Elementwise(TorchDispatchMode):
    """Counts the arithmetic of the elementwise ops and reductions that run, one per add,
    multiply, division or exp (torch's FLOP counter counts matmuls alone); any other op
    that computes is refused, so nothing goes uncounted."""

    FREE = {"view", "movedim", "permute", "clone", "copy_", "_to_copy", "empty_like",
            "transpose", "detach", "alias", "unsqueeze", "expand", "t", "_unsafe_view"}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("add", "add_", "div", "div_", "mul", "mul_", "sub", "sub_", "exp"):
            self.flops += out.numel()
        elif name == "sum":
            self.flops += args[0].numel() - out.numel()
        elif name == "_softmax":  # exp, the row's adds, a division each
            rows, width = out.numel() // out.shape[args[1]], out.shape[args[1]]
            self.flops += rows * (3 * width - 1)
        elif name not in self.FREE:
            raise AssertionError(f"uncounted op {name}")
        return out


def _elementwise(fn, *args) -> int:
    with torch.no_grad(), _Elementwise() as mode:
        fn(*args)
    return mode.flops


@pytest.mark.parametrize("n,iters", [(1, 1), (2, 3), (4, 20), (6, 7)])
def test_mhc_flops_count_its_sinkhorn_iterations(n, iters):
    """inspect's FLOPs left mHC's Sinkhorn iterations out (1,308 a point per token at n = 4
    and 20 iterations, more than a [n d, n] matrix at d = 40); they are what the iterations
    restopo runs compute, counted op by op, and grow with the spec's `sinkhorn`."""
    from restopo.nn.flops import sinkhorn_flops
    from restopo.spec import parse_spec
    tokens = 3
    counted = _elementwise(lambda z: sinkhorn_iterations(z, iters), torch.randn(tokens, n, n))
    assert sinkhorn_flops(n, iters) == counted / tokens
    spec = parse_spec("model m { vocab: 16; width: 8; depth: 2; heads: 2; context: 8 }\n"
                      f"residual mhc(streams: {n}, sinkhorn: {iters})\n")
    more = parse_spec(spec.text.replace(f"sinkhorn: {iters}", f"sinkhorn: {iters + 1}"))
    extra = (flops_per_token(more.ir(), more.model).aggregations
             - flops_per_token(spec.ir(), spec.model).aggregations)
    one_more = _elementwise(lambda z: sinkhorn_iterations(z, iters + 1), torch.randn(1, n, n))
    assert extra == spec.model.sublayers * (one_more - counted / tokens)


def _attend_reference(sources, query, gain, heads):
    """Depth attention written as matmuls, so torch's counter sees every multiply-add that
    grows with d: the logit w . RMSNorm(v_i) as (w * gain) . v_i times 1/RMS(v_i), whose mean
    square is one more product (none without a key norm), and the weighted sum."""
    d = sources.shape[-1]
    x = sources.movedim(0, -2)                                  # [B, T, n, d]
    split = x.unflatten(-1, (heads, d // heads)).transpose(-3, -2)  # [B, T, heads, n, d/h]
    q = (query if gain is None else query * gain).view(heads, d // heads, 1)
    logits = (split @ q).squeeze(-1)                            # [B, T, heads, n]
    if gain is not None:
        ms = (x.unsqueeze(-2) @ x.unsqueeze(-1)).squeeze(-1) / d  # [B, T, n, 1]
        logits = logits * torch.rsqrt(ms + 1e-6).transpose(-2, -1)
    alpha = logits.softmax(-1)
    return (alpha.unsqueeze(-2) @ split).squeeze(-2).flatten(-2)  # matmuls even for n = 1


@pytest.mark.parametrize("options", ["", "key_norm: none", "heads: 4", "gate: sigmoid"])
def test_attend_point_flops_match_torchs_counter_on_a_reference(options):
    """Full AttnRes's aggregation FLOPs are what torch counts for depth attention written as
    matmuls at every point (Full has no running sums). Without a key norm no mean square is
    taken: the count charged 6d per source either way, 2d too many."""
    from restopo.nn.aggregate import Attend
    from restopo.nn.flops import aggregation_flops
    from restopo.spec import parse_spec
    residual = f"full_attnres({options})" if options else "full_attnres"
    d, depth = 32, 2
    spec = parse_spec(f"model m {{ vocab: 16; width: {d}; depth: {depth}; heads: 2; "
                      f"context: 8 }}\nresidual {residual}\n")
    g = spec.ir()
    counted = 0.0
    for a in g.aggregations():
        module = Attend(d, key_norm=a.key_norm, heads=a.heads)  # a softmax reference
        torch.nn.init.normal_(module.pseudo_query)
        sources = torch.randn(len(a.sources), 1, 5, d)
        gain = module.gain
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            h = _attend_reference(sources, module.pseudo_query, gain, a.heads)
        torch.testing.assert_close(h, module(*sources).detach())  # it is depth attention
        counted += counter.get_total_flops() / 5
    assert aggregation_flops(g, d) == counted


def test_stream_head_sums_the_streams():
    a = Aggregation(index=5, before="head", method="mhc", sources=("streams5",), block=2, j=0,
                    streams=4)
    assert stream_flops(a, 64) == 3 * 64


@pytest.mark.parametrize("example", ["full_attnres", "mhc"])
def test_inspect_reports_flops_per_token(example, capsys):
    path = f"examples/{example}.restopo"
    assert main(["inspect", path, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)["flops_per_token"]
    spec = load_spec(path)
    f = flops_per_token(spec.ir(), spec.model)
    assert got == {"sublayers": f.sublayers, "head": f.head, "aggregations": f.aggregations,
                   "forward": f.forward, "train": f.train}
    assert got["aggregations"] > 0 and got["train"] == 3 * got["forward"]
    assert main(["inspect", path]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "FLOPs per token" in ln)
    assert f"{f.forward:,.0f} forward" in line and f"{f.train:,.0f} per training step" in line


def _train(tmp_path, *extra, every=0):
    out = tmp_path / "run"
    argv = ["train", "examples/tiny.restopo", "--out", str(out), "--no-progress", "--steps", "3",
            "--set", "train.batch=2", "--set", f"train.eval_every={every}", "--set",
            f"train.save_every={every}", "--set", "train.log_every=1", *extra]
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_mfu_in_metrics_with_a_given_peak(tmp_path):
    records = _train(tmp_path, "--peak-tflops", "0.05")
    spec = load_spec("examples/tiny.restopo")
    per_token = flops_per_token(spec.ir(), spec.model).train
    assert len(records) == 3 and "mfu" not in records[0]  # the first step: no rate
    for r in records[1:]:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 0.05e12, rel=1e-12)


def _slowed(monkeypatch):
    """The training loop's clock, and a wrapper that makes a call take 1000 s on it. The
    clock is the loop's own, moved on, not slept: a loaded machine's slow steps cannot fail
    the tests that use it."""
    from restopo.train import loop

    skipped = [0.0]

    class Clock:  # the time module, its perf_counter ahead by what the slow calls took
        def __getattr__(self, name):
            return getattr(time, name)

        def perf_counter(self):
            return time.perf_counter() + skipped[0]

    def slow(fn, calls=None):  # the first `calls` calls (None: all)
        def wrapped(*args, **kwargs):
            if calls is None or wrapped.n < calls:
                skipped[0] += 1000.0
            wrapped.n += 1
            return fn(*args, **kwargs)
        wrapped.n = 0
        return wrapped

    monkeypatch.setattr(loop, "time", Clock())
    return slow


def test_tokens_per_s_leaves_out_evaluation_and_checkpoints(tmp_path, monkeypatch):
    """An evaluation or a checkpoint write in a logging interval is not training: made to
    take 1000 s each on the loop's clock here, tokens/s must still be a step's (each line
    is one 128-token step; with those 1000 s counted it would be under 0.13). Step 2's
    line has step 1's checkpoint and its own evaluation in its interval."""
    from restopo.train import loop

    slow = _slowed(monkeypatch)
    monkeypatch.setattr(loop.DataParallelStep, "evaluate",
                        slow(loop.DataParallelStep.evaluate))
    monkeypatch.setattr(loop, "save_checkpoint", slow(loop.save_checkpoint))
    records = _train(tmp_path, "--set", "train.keep=1", every=1)
    assert [r["val_loss"] is not None for r in records] == [True] * 3
    assert all(r["tokens_per_s"] > 1 for r in records[1:]), records
    assert records[-1]["elapsed"] > 5000  # the slow calls did pass on the loop's clock
    assert (tmp_path / "run" / "ckpt" / "step_000003").is_dir()


@pytest.mark.parametrize("first", ["compiles", "builds kernels", "resumes"])
def test_tokens_per_s_leaves_out_a_runs_first_step(first, tmp_path, monkeypatch):
    """A run's first step carries one-time costs: with --compile it compiles the model
    (seconds to minutes), and without it kernels are built or JIT-compiled and memory first
    allocated, a resumed run's too; its tokens/s and MFU were that time's, not a step's.
    Made to take 1000 s on the loop's clock here (a compiler faked), the first step's line
    has no rate at all (nothing but that step in it), and the next lines a step's."""
    from restopo.train import compile as train_compile
    from restopo.train import loop

    before = len(_train(tmp_path)) if first == "resumes" else 0
    slow = _slowed(monkeypatch)
    monkeypatch.setattr(loop.DataParallelStep, "step", slow(loop.DataParallelStep.step, 1))
    monkeypatch.setattr(train_compile, "compile_model", lambda model, stepper, mode: 2)
    monkeypatch.setenv(train_compile.BACKEND_ENV, "eager")  # no C++ compiler asked for
    extra = {"compiles": ["--compile"], "builds kernels": [],
             "resumes": ["--resume", "--steps", "6"]}[first]
    records = _train(tmp_path, *extra, "--peak-tflops", "0.05")[before:]
    assert len(records) == 3
    assert "tokens_per_s" not in records[0] and "mfu" not in records[0], records[0]
    assert all(r["tokens_per_s"] > 1 and r["mfu"] > 0 for r in records[1:]), records
    assert records[0]["elapsed"] > 1000  # the slow step did pass on the loop's clock


def test_no_mfu_on_the_cpu_without_a_peak(tmp_path):
    records = _train(tmp_path)
    assert all("mfu" not in r for r in records)
    assert all(r["tokens_per_s"] > 0 for r in records[1:])


def test_a_bad_peak_is_said_where_it_was_written(tmp_path, capsys):
    assert main(["train", "examples/tiny.restopo", "--out", str(tmp_path / "r"),
                 "--peak-tflops", "0"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("<--peak-tflops>:1:15: error: 'peak_tflops' must be greater than 0")
    assert "    --peak-tflops 0.0\n" in err  # the flag as typed, not a --set never written
    assert "Traceback" not in err


def test_default_peak_by_device_name(monkeypatch):
    assert throughput.default_peak(torch.device("cpu")) is None
    for name, peak in [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA H100 NVL", 835.5e12), ("NVIDIA H200 NVL", 835.5e12),
                       ("NVIDIA H200", 989e12), ("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12),
                       ("Some GPU", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert throughput.default_peak(torch.device("cuda", 0)) == peak
    t = throughput.Throughput.of(6.0, torch.device("cpu"), devices=4, peak_tflops=2.0)
    assert t.peak == 8e12 and t.mfu(1e12) == pytest.approx(0.75)
