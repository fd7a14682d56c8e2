"""bench/gpu_check.sh --dry-run: every step of the GPU check (device tests, the kernel
benchmark with every case and arm, eager vs triton training) runs end to end on tiny shapes
on the CPU under the interpreter and prints its one table; only the speed is left to a GPU."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and timeout")
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable)
    cmd = ["bash", SCRIPT, "--dry-run", "--limits", "300,280,290", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return res, out


def test_every_step_runs_and_the_table_says_so(dry_run):
    res, out = dry_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = res.stdout[res.stdout.index("GPU check of the fused path"):]
    for step in ("tests", "kernels", "train-eager", "train-triton"):
        assert f"step {step}" in table and "FAILED" not in table, table
    for check in ("kernel tests on the device (vs eager)", "block d=64: fused fwd+bwd",
                  "phase2 d=64: phase2+norm / compiled add+rms_norm, fwd+bwd",
                  "saved for backward, full_attnres", "saved for backward, block_attnres",
                  "restopo train, 2 steps, eager vs triton"):
        assert check in table, check
    assert "max |loss diff| 0.0000" in table  # fp32 on the CPU: the same losses exactly
    for step, limit in (("tests", 300), ("kernels", 280), ("train-eager", 290)):
        assert f"== {step} (at most {limit}s" in res.stdout  # --limits, to fit a device lease


@pytest.mark.parametrize("limits", ["1,x,3", "100,200", "0,1,2"])
def test_limits_that_are_not_three_whole_seconds_are_refused(limits):
    res = subprocess.run(["bash", SCRIPT, "--limits", limits], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "--limits takes three whole seconds" in res.stderr


def test_the_benchmark_ran_every_arm(dry_run):
    _, out = dry_run
    rows = [json.loads(line) for line in open(out / "kernels.jsonl")]
    arms = {(r["case"], r["variant"]) for r in rows if r.get("ms") is not None}
    for case, variant in [("full", "fused triton (single read)"),
                          ("full", "eager (list of sources)"),
                          ("full", "copy of the same bytes"),
                          ("block", "fused triton (two-phase, fused norm)"),
                          ("block", "eager two-phase + norm"),
                          ("block", "eager, S single aggregations + norm"),
                          ("block", "copy of the same bytes"),
                          ("phase2", "fused phase2+norm (y only: in-model), fwd+bwd"),
                          ("phase2", "compile(add + rms_norm), fwd+bwd")]:
        assert (case, variant) in arms, (case, variant)
    assert any(r["variant"].startswith("torch.compile(eager") for r in rows)
    peers = [r for r in rows if r["variant"].startswith("peer")]
    assert peers and all(r.get("ms") is not None or r["note"] for r in peers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_gpu_or_dry_run_it_says_so(tmp_path):
    res = subprocess.run(["bash", SCRIPT, "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert res.returncode == 1 and "no CUDA device here" in res.stderr


def test_the_table_survives_arms_that_failed(tmp_path):
    # a GPU run where the fused kernel failed (as it did under triton 3.6's interpreter): the
    # table must still print, every other figure in it, and say FAIL, never a traceback
    (tmp_path / "status").write_text("tests 0 5\nkernels 124 300\n")
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="4" failures="0" errors="0" skipped="0"/></testsuites>')
    rows = [dict(case="block", d=2048, variant="fused triton (two-phase, fused norm)", ms=None,
                 note="failed: InterpreterError"),
            dict(case="block", d=2048, variant="eager two-phase + norm", ms=3.5, gbps=10.0,
                 of_copy=0.1, vs_fused=None),
            dict(case="block", d=2048, variant="peer fla-core (per read)", ms=None,
                 note="not run: does not import (ValueError: key)"),
            dict(case="full", d=2048, variant="fused triton (single read)", ms=1.0, gbps=1e3,
                 of_copy=0.5, vs_fused=None),
            dict(case="full", d=2048, variant="peer fast-attnres", ms=2.0, gbps=5e2,
                 of_copy=0.25, vs_fused=2.0),
            dict(case="saved", d=64, variant="full_attnres", eager_mib=2.0)]  # no ratio
    (tmp_path / "kernels.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"case": "phase2", "d": 20')  # torn
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check_table.py"),
                          str(tmp_path), "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    lines = {line.split("  ")[0]: line for line in res.stdout.splitlines()}
    assert lines["step kernels"].rstrip().endswith("TIMEOUT")
    assert "failed: InterpreterError" in lines[
        "block d=2048: fused triton (two-phase, fused norm)"]
    assert lines["block d=2048: fused triton (two-phase, fused norm)"].rstrip().endswith("FAIL")
    assert "3.500 ms" in lines["block d=2048: eager two-phase + norm"]
    assert lines["full d=2048: peer fast-attnres time / fused time"].rstrip().endswith("PASS")
    assert "unreadable" in lines["bench row saved full_attnres"]
    assert "unreadable line" in lines["bench/triton_depth.py"]
    assert lines["restopo train, eager vs triton"].rstrip().endswith("FAIL")  # no losses
