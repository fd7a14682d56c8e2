"""Kill and corrupt: random SIGKILLs of `restopo train`, random byte flips in the newest
checkpoint after each kill, then `--resume` until the run completes. Prints, side by side
with an uninterrupted run of the same spec, whether every logged loss is equal bit for bit,
and whether every flip was detected (the next resume named the damaged checkpoint).

    python bench/kill_corrupt.py                    # 12 kills, flips after ~2 of 3
    python bench/kill_corrupt.py --kills 40 --seed 3

CPU only; a tiny model on the repository's frozen corpus. tests/test_kill_corrupt.py runs
it (short by default, long under -m long).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = f"""\
model t {{ vocab: 256; width: 32; depth: 2; heads: 4; context: 32 }}
residual block_attnres(blocks: 2)
train {{
  data: "{ROOT / 'tests' / 'golden' / 'corpus.txt'}"
  steps: STEPS; batch: 4; lr: 3e-3; warmup: 2
  eval_every: 5; eval_batches: 1; save_every: 3; log_every: 1
}}
"""
DAMAGED = "is damaged ("


def _cmd(spec: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "restopo", "train", str(spec), "--out", str(out),
            "--no-progress", *extra]


def _records(out: Path) -> list[dict]:
    keep = ("step", "loss", "val_loss", "lr")
    return [{k: r.get(k) for k in keep} for r in map(
        json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def _newest(out: Path) -> Path | None:
    steps = sorted(p for p in (out / "ckpt").glob("step_*") if (p / "manifest.json").exists())
    return steps[-1] if steps else None


def _flip(rng: random.Random, step_dir: Path) -> str:
    """Flip 1 to 64 bytes at a random place of a random file of the checkpoint."""
    files = sorted(p for p in step_dir.iterdir() if p.is_file())
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    at, n = rng.randrange(len(data)), rng.randint(1, 64)
    for i in range(at, min(at + n, len(data))):
        data[i] ^= rng.randint(1, 255)  # never 0: every byte in range changes
    path.write_bytes(bytes(data))
    return f"{step_dir.name}/{path.name}@{at}+{n}"


def _logged(out: Path) -> int:
    try:
        return (out / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def _kill_at_random(rng: random.Random, proc: subprocess.Popen, out: Path,
                    ref_s: float) -> bool:
    """SIGKILL `proc` at a random point: one time in four during start-up (a random time),
    else once it has logged 1 to 4 more steps (so every run makes progress, and the kill
    lands anywhere in a step: forward, backward, a save, a prune). False if it ended first."""
    if rng.random() < 0.25:
        deadline = time.monotonic() + rng.uniform(0.05, 0.5) * ref_s
        until = lambda: time.monotonic() >= deadline  # noqa: E731
    else:
        target = _logged(out) + rng.randint(1, 4)
        until = lambda: _logged(out) >= target  # noqa: E731
    while proc.poll() is None:
        if until():
            proc.send_signal(signal.SIGKILL)
            return True
        time.sleep(0.01)
    return False


def run(kills: int = 12, seed: int = 0, steps: int = 60, flip_p: float = 0.67,
        folder: Path | None = None, say=print) -> dict:
    rng = random.Random(seed)
    folder = Path(folder or tempfile.mkdtemp(prefix="kill_corrupt-"))
    spec = folder / "t.restopo"
    spec.write_text(SPEC.replace("STEPS", str(steps)))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    t0 = time.perf_counter()
    ref = folder / "reference"
    subprocess.run(_cmd(spec, ref), env=env, check=True, capture_output=True, timeout=900)
    ref_s = time.perf_counter() - t0
    say(f"uninterrupted run: {steps} steps in {ref_s:.1f} s")

    out, flips, detected, killed, attempts = folder / "killed", [], [], 0, 0
    pending: list[str] = []  # flips no resume has reported yet
    fresh = True
    while True:
        attempts += 1
        proc = subprocess.Popen(_cmd(spec, out, "--overwrite" if fresh else "--resume"),
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        if killed < kills and _kill_at_random(rng, proc, out, ref_s):
            killed += 1
        err = proc.communicate(timeout=900)[1]
        for flip in list(pending):  # reported once a resume got as far as choosing
            if f"{flip.split('/')[0]} {DAMAGED}" in err:
                pending.remove(flip)
                detected.append(flip)
        if proc.returncode == 0:
            break
        if proc.returncode == 1 and "no intact checkpoint" in err:
            fresh = True  # every checkpoint was damaged: start over (and say so)
            say("every checkpoint damaged: starting over")
            continue
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"restopo train failed ({proc.returncode}):\n{err[-3000:]}")
        newest = _newest(out)
        fresh = newest is None
        if newest is not None and rng.random() < flip_p:
            flips.append(_flip(rng, newest))
            pending.append(flips[-1])
    equal = _records(out) == _records(ref)
    result = {"kills": killed, "runs": attempts, "flips": len(flips),
              "flips_detected": len(detected), "losses_equal": equal,
              "logged_steps": len(_records(out)), "undetected": pending}
    say(f"killed {killed} times over {attempts} runs; flipped bytes {len(flips)} times, "
        f"detected {len(detected)} of {len(flips)}; "
        f"losses {'equal' if equal else 'DIFFER'} to the uninterrupted run "
        f"({result['logged_steps']} logged steps)")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--flip-p", type=float, default=0.67)
    args = ap.parse_args(argv)
    result = run(args.kills, args.seed, args.steps, args.flip_p)
    print(json.dumps(result))
    ok = result["losses_equal"] and result["flips"] == result["flips_detected"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
