"""bench/overhead.py runs (CI-size smoke: eager only, tiny model) and prints ratios."""
import importlib.util
from pathlib import Path


def test_overhead_bench_quick(capsys):
    path = Path(__file__).resolve().parents[1] / "bench" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--no-compile", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("eager ")]
    assert [r[1] for r in rows] == ["standard", "full", "block2", "mhc4"]
    assert rows[0][3] == "1.000" and rows[0][7] == "1.000"
    assert float(rows[1][7]) > 1.0  # Full keeps every source for backward: more than standard
    assert float(rows[3][7]) > 1.0  # so does mHC: its n streams at every sublayer


def test_overhead_bench_regional_mode(capsys, monkeypatch):
    """--regional measures each topology with its regions compiled (aot_eager here: the
    same regions without inductor's C++ builds), beside eager, as ratios to standard."""
    monkeypatch.setenv("RESTOPO_COMPILE_BACKEND", "aot_eager")
    path = Path(__file__).resolve().parents[1] / "bench" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--no-compile", "--regional", "--streams", "0",
                       "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("regional ")]
    assert [r[1] for r in rows] == ["standard", "full", "block2"]
    assert rows[0][3] == "1.000" and float(rows[1][7]) > 1.0
