"""Hostile inputs for the spec front end, and a driver that feeds them to `restopo check`.

Beyond mutations of the examples (test_spec_fuzz.py), `cases()` makes what an adversarial
user would try: huge and odd numbers, deep nesting, long files and lines, control bytes,
unicode, hostile --set overrides, oversized models, and paths that are not text files
(FIFOs, devices, folders, link loops, /proc files, names too long, files over the cap).

`drive()` runs each case through the CLI in this process, under a per-case time limit
(SIGALRM), and sorts the outcome: accepted (exit 0), a clean error (exit 1, no traceback),
or a failure: a traceback (any exception out of main), a hang (over the limit) or a memory
blow-up (MemoryError; run it under an address-space limit, as the tests do, so that a
blow-up is an error and not the machine's memory). Stdlib and restopo only; no torch.

    python tests/hostile.py --cases 300 --seed 0 --dir /tmp/h   # prints a JSON summary
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import signal
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.restopo"))
BASE = "model m { vocab: 256; width: 64; depth: 2; heads: 4; context: 64 }\n"
KEYS = ["vocab", "width", "depth", "heads", "context", "mlp", "mlp_ratio", "layer",
        "tie_embeddings", "steps", "batch", "lr", "warmup", "min_lr", "weight_decay",
        "grad_clip", "accum", "eval_every", "eval_batches", "save_every", "seed", "log_every",
        "blocks", "block_size", "window", "heads", "stages", "virtual", "microbatches"]
NUMBERS = ["0", "-0", "1", "-1", "1e999", "-1e999", "1e-999", "9" * 400, "-" + "9" * 5000,
           "1_000_000_000k", "2M", "4096", "4097", "65536", "2147483647", "2147483648",
           "1.5", "0.0000001", "3e-3", "4x", "1x", "0x10", "1e", "1__0", "100000000",
           "1" + "0" * 60, "18446744073709551616", "7k", "999M"]
WEIRD = ["\x00", "\x01", "\x07", "\x08", "\x0b", "\x0c", "\r", "\x1b[31m", "\x7f", "\x85",
         "\u2028", "\u2029", "\ufeff", "\u200b", "\u202e", "e\u0301", "\U0001f600", "\uff14",
         "ß", "İ", "\t", "\\", '"', "'", "'''", '"""', "#", ";", ":", "{", "}", "(", ")"]


class Timeout(BaseException):
    """Raised by the alarm inside a case that ran over its time (never caught by code that
    catches Exception)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise Timeout in the main thread after `seconds` (SIGALRM). Nests: an enclosing
    limit keeps running, and fires on time, after an inner one ends."""
    def expire(signum, frame):
        raise Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    start = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    if outer:
        signal.setitimer(signal.ITIMER_REAL, min(seconds, outer))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


# -- the generator ---------------------------------------------------------------------------
def _numbers(rng: random.Random) -> str:
    entries = "; ".join(f"{rng.choice(KEYS)}: {rng.choice(NUMBERS)}"
                        for _ in range(rng.randint(1, 6)))
    section = rng.choice(["model m", "train", "residual custom", "parallel"])
    return (f"{BASE if section != 'model m' else ''}{section} {{ {entries} }}\n"
            f"residual {rng.choice(['standard', 'full_attnres', 'block_attnres(blocks: 2)'])}\n")


def _nesting(rng: random.Random) -> str:
    n = rng.choice([8, 16, 17, 50, 165, 1000, 20_000])
    opener = rng.choice(["f(", "(", "{", "f({", "window("])
    closer = "".join({"(": ")", "{": "}"}[c] for c in reversed(opener) if c in "({")
    inner = opener * n + "x" + closer * n
    where = rng.choice([f"residual {inner}", f"residual custom {{ before sublayer: {inner} }}",
                        f"train {{ data: {inner} }}", inner])
    return BASE + where + "\n"


def _long(rng: random.Random) -> str:
    kind = rng.choice(["keys", "line", "name", "string", "comment", "sections", "list"])
    n = rng.choice([1_000, 5_000, 20_000])
    if kind == "keys":
        body = "".join(f"k{i}: {i}\n" for i in range(n))
        return f"model m {{\n{body}}}\nresidual standard\n"
    if kind == "line":
        return BASE + "residual standard " + "; ".join(["x"] * n) + "\n"
    if kind == "name":
        return BASE + "residual " + "a" * (n * 10) + "\n"
    if kind == "string":
        return BASE + 'residual standard\ntrain { data: "' + "p" * (n * 10) + '" }\n'
    if kind == "comment":
        return BASE + "#" + "c" * (n * 10) + "\nresidual standard\n"
    if kind == "sections":
        return BASE * (n // 10) + "residual standard\n"
    return BASE.replace("context: 64", "context: 64; layer: " + " ".join(["attn", "mlp"] * n)) \
        + "residual standard\n"


def _bytes(rng: random.Random) -> str:
    text = list(rng.choice(EXAMPLES).read_text())
    for _ in range(rng.randint(1, 8)):
        text.insert(rng.randint(0, len(text)), rng.choice(WEIRD))
    return "".join(text)


def _unicode(rng: random.Random) -> str:
    word = "".join(rng.choice(WEIRD[9:] + list(string.ascii_letters)) for _ in range(6))
    return rng.choice([
        BASE + f"residual {word}\n", BASE + f"residual standard\ntrain {{ data: \"{word}\" }}\n",
        f"model {word} {{ vocab: 256; width: 64; depth: 2; heads: 4; context: 64 }}\n"
        "residual standard\n", BASE + f"residual custom {{ before sublayer: attend({word}) }}\n",
        BASE + f"{word}: 1\nresidual standard\n"])


def _sizes(rng: random.Random) -> str:
    depth = rng.choice([1024, 2048, 4096, 4097, 65536])
    topo = rng.choice(["standard", "full_attnres", "denseformer", "rezero",
                       "block_attnres(blocks: 2)", "full_attnres(window: 4)",
                       "custom { before sublayer: attend(embedding, sublayers) }"])
    width, vocab = rng.choice([(64, 256), (65536, 256), (64, 2147483647), (8192, 50000)])
    train = rng.choice(["", "train { batch: 100000000 }", "train { batch: 65536 }",
                        "train { eval_batches: 2147483647 }", "train { accum: 3 }"])
    return (f"model m {{ vocab: {vocab}; width: {width}; depth: {depth}; heads: 4; "
            f"context: {rng.choice([64, 131072, 131073, 2147483647])} }}\n"
            f"residual {topo}\n{train}\n")


def _mutation(rng: random.Random) -> str:
    toks = list(rng.choice(EXAMPLES).read_text())
    i = rng.randint(0, len(toks))
    return "".join(toks[:i] + [rng.choice(NUMBERS + WEIRD)] + toks[i + rng.randint(0, 5):])


TEXTS = {"numbers": _numbers, "nesting": _nesting, "long": _long, "control bytes": _bytes,
         "unicode": _unicode, "sizes": _sizes, "mutation": _mutation}
OVERRIDES = ["model.depth=4096", "model.depth=" + "9" * 50, "residual=" + "f(" * 200,
             "train.data=~", "train.data=/dev/zero", "train.batch=100000000", "=", "..=",
             "model.width=\x00", "residual=full_attnres", "model.depth=2000", "x" * 5000]


def _special(rng: random.Random, folder: Path, i: int) -> tuple[str, str]:
    """A path that is not a spec file (or a file at the size cap)."""
    try:
        from restopo.spec.files import MAX_SPEC_BYTES
    except ImportError:  # an older restopo, measured for comparison
        MAX_SPEC_BYTES = 1 << 16

    kind = rng.choice(["fifo", "dev/zero", "dev/null", "dev/urandom", "folder", "link loop",
                       "dangling link", "proc/self/mem", "name too long", "over the cap",
                       "sparse huge", "at the cap", "not utf-8", "bom", "empty"])
    p = folder / f"special{i}.restopo"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind.startswith("dev/") or kind.startswith("proc/"):
        return kind, "/" + kind
    elif kind == "folder":
        p.mkdir()
    elif kind == "link loop":
        os.symlink(folder / f"special{i}.b", p)
        os.symlink(p, folder / f"special{i}.b")
    elif kind == "dangling link":
        os.symlink(folder / "nowhere", p)
    elif kind == "name too long":
        return kind, str(folder / ("n" * 300 + ".restopo"))
    elif kind == "over the cap":
        p.write_text("# " + "x" * MAX_SPEC_BYTES + "\n")
    elif kind == "sparse huge":
        with open(p, "wb") as f:
            f.truncate(1 << 40)  # a terabyte of zeros, none of it on disk
    elif kind == "at the cap":
        line = "#" + "x" * 98 + "\n"
        p.write_text(BASE + "residual standard\n" + line * ((MAX_SPEC_BYTES - 200) // 100))
    elif kind == "not utf-8":
        p.write_bytes(b"model \xff\xfe { }\n")
    elif kind == "bom":
        p.write_bytes(b"\xef\xbb\xbf" + (BASE + "residual standard\n").encode())
    else:
        p.write_bytes(b"")
    return kind, str(p)


def cases(n: int, seed: int, folder: Path):
    """(family, path, overrides) for n cases; files are made in `folder`."""
    rng = random.Random(seed)
    families = list(TEXTS) + ["special", "override"]
    for i in range(n):
        family = families[i % len(families)]
        if family == "special":
            kind, path = _special(rng, folder, i)
            yield f"special: {kind}", path, ()
            continue
        overrides = ()
        if family == "override":
            overrides = tuple(rng.sample(OVERRIDES, rng.randint(1, 2)))
            text = BASE + "residual block_attnres(blocks: 2)\n"
        else:
            text = TEXTS[family](rng)
        p = folder / f"case{i}.restopo"
        p.write_bytes(text.encode("utf-8", "surrogatepass"))
        yield family, str(p), overrides


# -- the driver -----------------------------------------------------------------------------
def run_case(path: str, overrides, limit_s: float) -> tuple[str, str]:
    """(outcome, detail): outcome accepted | clean | traceback | hang | memory."""
    from restopo.cli import main

    argv = ["check", path] + [a for o in overrides for a in ("--set", o)]
    out, err = io.StringIO(), io.StringIO()
    try:
        with time_limit(limit_s), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            code = main(argv)
    except Timeout:
        return "hang", f"over {limit_s} s"
    except MemoryError:
        return "memory", "MemoryError"
    except BaseException as e:  # anything out of main is a traceback to the user
        return "traceback", f"{type(e).__name__}: {str(e)[:200]}"
    text = err.getvalue()
    if "Traceback" in text:
        return "traceback", text[-300:]
    if code == 0:
        return "accepted", ""
    first = text.splitlines()[0] if text.strip() else ""
    if code == 1 and CLEAN.match(first):
        return "clean", first[:160]
    # argparse's usage error (a --set key given twice): the usage, then one error line
    last = text.splitlines()[-1] if text.strip() else ""
    if code == 2 and first.startswith("usage: ") and CLEAN.match(last):
        return "clean", last[:160]
    return "traceback", f"exit {code} with stderr {text[:200]!r}"


# What a clean error opens with: restopo's own one line, or a spec error's FILE:LINE:COL.
CLEAN = re.compile(r"^(restopo( [a-z]+)?: error: |.*:\d+:\d+: error: )")


def drive(n: int, seed: int, folder: Path, limit_s: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    counts = {"cases": 0, "accepted": 0, "clean": 0, "traceback": 0, "hang": 0, "memory": 0}
    failures, families, slowest = [], {}, (0.0, "")
    for family, path, overrides in cases(n, seed, folder):
        t0 = time.perf_counter()
        outcome, detail = run_case(path, overrides, limit_s)
        dt = time.perf_counter() - t0
        slowest = max(slowest, (dt, family))
        counts["cases"] += 1
        counts[outcome] += 1
        fam = families.setdefault(family.split(":")[0], {"accepted": 0, "clean": 0, "bad": 0})
        fam[outcome if outcome in ("accepted", "clean") else "bad"] += 1
        if outcome not in ("accepted", "clean"):
            failures.append({"family": family, "path": path, "overrides": list(overrides),
                             "outcome": outcome, "detail": detail})
    return {**counts, "families": families, "slowest_case_s": round(slowest[0], 2),
            "slowest_family": slowest[1], "failures": failures[:20]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--limit", type=float, default=30.0, help="seconds per case")
    args = ap.parse_args(argv)
    print(json.dumps(drive(args.cases, args.seed, Path(args.dir), args.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
