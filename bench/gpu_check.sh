#!/usr/bin/env bash
# The fused path's GPU check, in one script (about 5-8 minutes on one H100 or H200):
#   1. the kernel tests on CUDA: tests/triton/test_triton_device.py, each op through the
#      in-model call path against eager, fp32 and bf16, d 2048 and 7168, up to 512k rows
#   2. bench/triton_depth.py at the in-model call path: fused vs eager vs torch.compile(eager) vs
#      a copy of the same bytes (and the peer packages that import: fast-attnres, fla-core,
#      flash-attn-res), forward+backward, bf16, 64k rows; and saved-for-backward bytes
#   3. 50 steps of `restopo train` under bf16 autocast on CUDA, backend eager then triton
# then prints one table: every figure next to its goal (the goals of issue 12).
#
#   bench/gpu_check.sh                 # on the GPU machine, from the repository root
#   bench/gpu_check.sh --out DIR       # keep the logs and raw results in DIR
#   bench/gpu_check.sh --dry-run       # anywhere: every step on tiny shapes on the CPU
#                                      # under triton's interpreter (timings mean nothing)
#   bench/gpu_check.sh --limits 150,240,60   # seconds allowed to the tests, the benchmark and
#                                      # each training run (default 200,300,150), to fit a lease
#
# Exit status: 0 when every step ran and every correctness check passed (tests, equal
# losses); 1 otherwise. A missed speed goal is marked MISS in the table, not an error.
# The correctness steps run with RESTOPO_TRITON_AUTOTUNE=0 (one compile per kernel); the
# benchmark autotunes as a model does.
set -uo pipefail

DRY=0
OUT=""
LIMITS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) OUT="$2"; shift ;;
        --limits) LIMITS="$2"; shift ;;
        -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$LIMITS" ] && ! [[ "$LIMITS" =~ ^[1-9][0-9]*,[1-9][0-9]*,[1-9][0-9]*$ ]]; then
    echo "gpu_check.sh: --limits takes three whole seconds, as 150,240,60 (got '$LIMITS')" >&2
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/restopo-gpu-check.XXXXXX")}"
mkdir -p "$OUT" || exit 2
PY="${PYTHON:-python}"

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 RESTOPO_GPU_CHECK_DRY=1
    DEVICE=cpu
    BENCH_ARGS=(--dry-run --widths 64)
    TRAIN_SPEC=examples/tiny.restopo
    TRAIN_ARGS=(--steps 2 --set model.depth=2 --set model.width=32 --set model.context=16
                --set train.batch=2 --set train.eval_every=2 --set train.eval_batches=1
                --set train.save_every=2 --set "train.data=\"$PWD/tests/golden/corpus.txt\"")
    LIMIT_TESTS=300; LIMIT_BENCH=300; LIMIT_TRAIN=300
else
    export TRITON_INTERPRET=0
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check.sh: no CUDA device here; run it on the GPU machine (or --dry-run)" >&2
        exit 1
    fi
    DEVICE=cuda
    BENCH_ARGS=(--iters 10 --warmup 2)
    TRAIN_SPEC=examples/block_attnres.restopo
    TRAIN_ARGS=(--steps 50 --set train.eval_every=50 --set train.save_every=50)
    LIMIT_TESTS=200; LIMIT_BENCH=300; LIMIT_TRAIN=150
fi
[ -n "$LIMITS" ] && IFS=, read -r LIMIT_TESTS LIMIT_BENCH LIMIT_TRAIN <<< "$LIMITS"
rm -f "$OUT/kernels.jsonl" "$OUT/status"
echo "gpu_check: results in $OUT"

step() {  # step NAME LIMIT_S COMMAND...: run, log, record the exit status
    local name="$1" limit="$2"; shift 2
    echo "== $name (at most ${limit}s; log: $OUT/$name.log)"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$OUT/status"
    tail -n 3 "$OUT/$name.log"
}

step tests "$LIMIT_TESTS" env RESTOPO_TRITON_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider \
    tests/triton/test_triton_device.py --junitxml "$OUT/tests.xml"
step kernels "$LIMIT_BENCH" "$PY" bench/triton_depth.py "${BENCH_ARGS[@]}" --json "$OUT/kernels.jsonl"
for backend in eager triton; do
    step "train-$backend" "$LIMIT_TRAIN" env RESTOPO_TRITON_AUTOTUNE=0 "$PY" -m restopo train \
        "$TRAIN_SPEC" "${TRAIN_ARGS[@]}" --device "$DEVICE" --backend "$backend" \
        --out "$OUT/train-$backend" --overwrite --no-progress --set train.log_every=1
done

"$PY" - "$OUT" "$DRY" <<'EOF'
"""The one table: each figure of the steps above next to its goal."""
import json
import os
import sys
import xml.etree.ElementTree as ET

out, dry = sys.argv[1], sys.argv[2] == "1"
rows, failed = [], False


def row(check, measured, goal, verdict):
    rows.append((check, measured, goal, verdict))


status = {}
for line in open(os.path.join(out, "status")):
    name, rc, secs = line.split()
    status[name] = (int(rc), int(secs))
for name, (rc, secs) in status.items():
    verdict = "ok" if rc == 0 else ("TIMEOUT" if rc == 124 else f"FAILED (exit {rc})")
    failed |= rc != 0
    row(f"step {name}", f"{secs} s", "runs", verdict)

try:
    suite = ET.parse(os.path.join(out, "tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, bad = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
    skipped = int(suite.get("skipped"))
    failed |= bad > 0 or n - skipped == 0
    row("kernel tests on the device (vs eager)", f"{n - skipped - bad}/{n - skipped} passed",
        "all", "PASS" if bad == 0 and n > skipped else "FAIL")
except (OSError, ET.ParseError, TypeError, AttributeError) as exc:
    failed = True
    row("kernel tests on the device (vs eager)", f"no results ({exc})", "all", "FAIL")

bench = []
path = os.path.join(out, "kernels.jsonl")
if os.path.exists(path):
    bench = [json.loads(line) for line in open(path)]
for r in bench:
    case, d, variant = r["case"], r["d"], r["variant"]
    if case in ("full", "block") and variant.startswith("fused"):
        goal = ">= 70%" if case == "block" else "-"
        ok = r["of_copy"] >= 0.70
        row(f"{case} d={d}: fused fwd+bwd, of copy bandwidth", f"{r['of_copy']:.1%}", goal,
            ("PASS" if ok else "MISS") if case == "block" else "-")
    elif case in ("full", "block") and not variant.startswith("copy"):
        if r.get("ms") is None:
            row(f"{case} d={d}: {variant}", r.get("note", "not run"), "-", "-")
        else:
            faster = r["vs_fused"] is not None and r["vs_fused"] > 1
            peer = variant.startswith("peer")
            row(f"{case} d={d}: {variant} time / fused time", f"{r['vs_fused']:.2f}x",
                "> 1 (fused faster)" if peer else "-",
                ("PASS" if faster else "MISS") if peer else "-")
    elif case == "phase2" and "ratio" in r:
        row(f"phase2 d={d}: phase2+norm / compiled add+rms_norm, {variant.split(', ')[-1]}",
            f"{r['ratio']:.2f}x", "<= 1.2x", "PASS" if r["ratio"] <= 1.2 else "MISS")
    elif case == "saved":
        ok = r["ratio"] <= 1.0
        failed |= not ok
        row(f"saved for backward, {variant} (width {d})",
            f"{r['triton_mib']:.1f} / {r['eager_mib']:.1f} MiB", "triton <= eager",
            "PASS" if ok else "FAIL")
if not bench:
    failed = True
    row("bench/triton_depth.py", "no results", "runs", "FAIL")


def losses(backend):
    path = os.path.join(out, f"train-{backend}", "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    return {m["step"]: m["loss"] for m in map(json.loads, open(path)) if "loss" in m}


eager, fused = losses("eager"), losses("triton")
steps = sorted(set(eager) & set(fused))
if steps:
    diff = max(abs(eager[s] - fused[s]) for s in steps)
    ok = diff <= 0.02 and len(steps) == len(eager)
    failed |= not ok
    row(f"restopo train, {len(steps)} steps, eager vs triton",
        f"max |loss diff| {diff:.4f} (final {eager[steps[-1]]:.4f} / {fused[steps[-1]]:.4f})",
        "<= 0.02", "PASS" if ok else "FAIL")
else:
    failed = True
    row("restopo train, eager vs triton", "no losses", "same losses", "FAIL")

title = "GPU check of the fused path" + (" (DRY RUN: CPU interpreter, timings mean nothing)"
                                         if dry else "")
widths = [max(len(str(r[i])) for r in rows + [("check", "measured", "goal", "verdict")])
          for i in range(4)]
print("\n" + title)
for r in [("check", "measured", "goal", "verdict")] + rows:
    print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
sys.exit(1 if failed else 0)
EOF
