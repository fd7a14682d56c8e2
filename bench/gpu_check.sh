#!/usr/bin/env bash
# The fused path's GPU check, in one script (seen on an H200: the tests 32 s, each training
# run 25 s, the benchmark more than 7 minutes at its defaults):
#   1. the kernel tests on CUDA: tests/triton/test_triton_device.py, each op through the
#      in-model call path against eager, fp32 and bf16, d 2048 and 7168, up to 512k rows
#   2. 50 steps of `restopo train` under bf16 autocast on CUDA, backend eager then triton
#   3. bench/triton_depth.py at the in-model call path: fused vs eager vs torch.compile(eager) vs
#      a copy of the same bytes, forward+backward, bf16, 64k rows; and saved-for-backward bytes;
#      the fused arms profiled by kernel (in kernels.log)
#   4. bench/overhead.py, compiled (whole model), width 512: Full and Block AttnRes against
#      standard with auto's aggregations (inductor's code under torch.compile) and with the
#      triton custom ops, side by side (the table gives each one's step x standard)
#   5. each peer package that imports (fast-attnres, fla-core, flash-attn-res) against the fused
#      arm on the same shapes, each in a process of its own: a peer's illegal memory access
#      ends its process, not the other figures (one did, on an H200)
# then prints one table: every figure next to its goal (the goals of issue 12). The steps run
# in the order of what they decide, the shortest first, so a lease that runs out takes the
# least.
#
#   bench/gpu_check.sh                 # on the GPU machine, from the repository root
#   bench/gpu_check.sh --out DIR       # keep the logs and raw results in DIR
#   bench/gpu_check.sh --dry-run       # anywhere: every step on tiny shapes on the CPU
#                                      # under triton's interpreter (timings mean nothing)
#   bench/gpu_check.sh --limits 150,60,240,60  # seconds allowed to the tests, each training
#                                      # run, each benchmark and each peer (default
#                                      # 200,150,300,120), to fit a lease
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
        -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$LIMITS" ] && ! [[ "$LIMITS" =~ ^[1-9][0-9]*(,[1-9][0-9]*){3}$ ]]; then
    echo "gpu_check.sh: --limits takes four whole seconds, as 150,60,240,60 (got '$LIMITS')" >&2
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
    OVERHEAD_ARGS=(--quick --device cpu --no-compile)  # no compile: minutes on a CPU
    TRAIN_SPEC=examples/tiny.restopo
    TRAIN_ARGS=(--steps 2 --set model.depth=2 --set model.width=32 --set model.context=16
                --set train.batch=2 --set train.eval_every=2 --set train.eval_batches=1
                --set train.save_every=2 --set "train.data=\"$PWD/tests/golden/corpus.txt\"")
    LIMIT_TESTS=300; LIMIT_TRAIN=300; LIMIT_BENCH=300; LIMIT_PEER=300
else
    export TRITON_INTERPRET=0
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check.sh: no CUDA device here; run it on the GPU machine (or --dry-run)" >&2
        exit 1
    fi
    DEVICE=cuda
    BENCH_ARGS=(--iters 10 --warmup 2)
    OVERHEAD_ARGS=(--device cuda --compile-only --iters 5)
    TRAIN_SPEC=examples/block_attnres.restopo
    TRAIN_ARGS=(--steps 50 --set train.eval_every=50 --set train.save_every=50)
    LIMIT_TESTS=200; LIMIT_TRAIN=150; LIMIT_BENCH=300; LIMIT_PEER=120
fi
[ -n "$LIMITS" ] && IFS=, read -r LIMIT_TESTS LIMIT_TRAIN LIMIT_BENCH LIMIT_PEER <<< "$LIMITS"
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
for backend in eager triton; do
    step "train-$backend" "$LIMIT_TRAIN" env RESTOPO_TRITON_AUTOTUNE=0 "$PY" -m restopo train \
        "$TRAIN_SPEC" "${TRAIN_ARGS[@]}" --device "$DEVICE" --backend "$backend" \
        --out "$OUT/train-$backend" --overwrite --no-progress --set train.log_every=1
done
step kernels "$LIMIT_BENCH" "$PY" bench/triton_depth.py "${BENCH_ARGS[@]}" --peers none --profile \
    --json "$OUT/kernels.jsonl"
step overhead "$LIMIT_BENCH" "$PY" bench/overhead.py "${OVERHEAD_ARGS[@]}" --backend auto,triton \
    --streams 0
for peer in fast-attnres fla-core flash-attn-res; do
    step "peer-$peer" "$LIMIT_PEER" "$PY" bench/triton_depth.py "${BENCH_ARGS[@]}" \
        --peers "$peer" --cases block full --json "$OUT/kernels.jsonl"
done

"$PY" bench/gpu_check_table.py "$OUT" "$DRY"
