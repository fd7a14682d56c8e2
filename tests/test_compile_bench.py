"""bench/overhead.py and bench/aggregation.py run (CI-size smoke: eager only, tiny model) and
print their figures against the standard residual."""
import re

import pytest
import torch
from file_modules import bench as load_bench

from restopo import ops


def test_overhead_bench_quick(capsys):
    bench = load_bench("overhead")
    assert bench.main(["--quick", "--no-compile", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("eager ")]
    assert [r[1] for r in rows] == ["standard", "full", "block2", "mhc4"]
    assert rows[0][3] == "1.000" and rows[0][7] == "1.000"
    assert float(rows[1][7]) > 1.0  # Full keeps every source for backward: more than standard
    assert float(rows[3][7]) > 1.0  # so does mHC: its n streams at every sublayer


def test_overhead_bench_profiles_each_topology(capsys):
    """--profile N prints, per mode and topology, the top N ops of 3 profiled steps by self
    CPU time (the host side, where a fixed cost per call shows)."""
    bench = load_bench("overhead")
    assert bench.main(["--quick", "--no-compile", "--streams", "0", "--iters", "1",
                       "--profile", "4"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("--- profile:")]
    assert heads == [f"--- profile: eager {t}, 3 steps, by self_cpu_time_total"
                     for t in ("standard", "full", "block2")]
    assert out.count("Self CPU time total") == 3


def test_overhead_bench_regional_mode(capsys, monkeypatch):
    """--regional measures each topology with its regions compiled (aot_eager here: the
    same regions without inductor's C++ builds), beside eager, as ratios to standard."""
    monkeypatch.setenv("RESTOPO_COMPILE_BACKEND", "aot_eager")
    bench = load_bench("overhead")
    assert bench.main(["--quick", "--no-compile", "--regional", "--streams", "0",
                       "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("regional ")]
    assert [r[1] for r in rows] == ["standard", "full", "block2"]
    assert rows[0][3] == "1.000" and float(rows[1][7]) > 1.0


def test_overhead_bench_times_cpu_time_with_clock_cpu(capsys, monkeypatch):
    """--clock cpu times steps by the process's CPU time (here a fake clock that moves 0.25 s
    a reading), not wall time; it refuses more than one thread, whose CPU times would add."""
    bench = load_bench("overhead")
    ticks = iter(range(10**6))
    monkeypatch.setattr(bench.time, "process_time", lambda: 0.25 * next(ticks))
    assert bench.main(["--quick", "--no-compile", "--streams", "0", "--iters", "2",
                       "--threads", "1", "--clock", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "clock cpu" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("eager ")]
    assert [r[1] for r in rows] == ["standard", "full", "block2"]
    assert all(float(r[2]) == 250.0 and float(r[4]) == 250.0 for r in rows)
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--threads", "2", "--clock", "cpu"])
    assert "--threads 1" in capsys.readouterr().err


def test_aggregation_bench_quick(capsys):
    """bench/aggregation.py: each topology's aggregations over stand-in sublayers, as
    milliseconds beyond the standard residual's (which is 0 by definition)."""
    assert load_bench("aggregation").main(["--quick"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("eager ")]
    assert [r[1] for r in rows] == ["standard", "full", "block2", "mhc4"]
    assert float(rows[0][3]) == 0.0 and all(float(r[2]) > 0 for r in rows)


@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_aggregation_bench_runs_the_backend_it_names(backend):
    """The eager rows run `--backend`'s aggregations: by default (auto) the fused C kernels
    that restopo train runs on the CPU, not plain torch (the bench once always lowered on
    eager, so its figures were not the ones a training step pays)."""
    cpu = torch.device("cpu")
    if backend == "auto" and not ops.cpu_kernels("auto", cpu, torch.float32):
        pytest.skip("the C kernels do not build here")
    bench = load_bench("aggregation")
    args = bench.parse_args(["--quick"] + ([] if backend == "auto" else ["--backend", backend]))
    model = bench.build(args, bench.topologies(args)["block2"])
    kernels = [m.runs_kernels(cpu, torch.float32) for m in model.phases]
    assert kernels and all(k == (backend == "auto") for k in kernels)


def test_overhead_bench_counts_the_key_norm_once_a_source():
    """The rates' FLOPs: Full AttnRes at depth 4 reads 45 sources (8 points reading 1..8,
    the head 9) of 9 distinct ones: 4d a read (logit and weighted sum), 2d a source for its
    RMS, counted by hand here against the standard model's own aggregation count."""
    from restopo import topology as T
    from restopo.ir.build import build_ir
    from restopo.nn.flops import aggregation_flops

    bench = load_bench("overhead")
    args = bench.parse_args(["--quick"])
    kinds = T.sublayer_kinds(args.depth)
    d, tokens = args.width, args.batch * args.context
    extra = (bench.train_flops(args, T.full_attnres(kinds))
             - bench.train_flops(args, T.standard(kinds))) / (3 * tokens)
    assert extra == 45 * 4 * d + 9 * 2 * d - aggregation_flops(build_ir(kinds, T.standard(kinds),
                                                                        d), d)


def test_overhead_bench_prints_the_rate_each_goal_needs(capsys):
    """After the table, each topology's FLOP rate, its extra work's rate and, for Full and
    Block AttnRes, the rate that extra work would need for the mode's goal ratio."""
    bench = load_bench("overhead")
    assert bench.main(["--quick", "--no-compile", "--streams", "0", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    # the machine's own rates at the model's shapes (one thread, or the threads torch has)
    assert re.search(r"^  (this thread|\d+ threads): matmul \[128, 64\] @ \[64, \d+\] "
                     r"[\d.]+ GFLOP/s; acc \+= a v, \[128, 64\] [\d.]+ GFLOP/s", out, re.M), out
    rows = {line.split()[1]: line.split() for line in out.splitlines()
            if line.startswith("  eager ")}
    assert list(rows) == ["standard", "full", "block2"]
    assert rows["standard"][4:] == ["-"] * 5
    for name, goal in (("full", "1.30"), ("block2", "1.10")):
        r = rows[name]
        assert float(r[4]) > 0 and r[7] == goal
        std_s = float(rows["standard"][2]) / float(rows["standard"][3])  # GFLOP / GFLOP/s
        assert float(r[8]) == pytest.approx(float(r[4]) / ((float(goal) - 1) * std_s), rel=0.05)
