"""Fuzz: mutated example specs give a valid spec or a SpecError, never another exception; and
hostile inputs (tests/hostile.py: huge numbers, deep nesting, long files, special files,
control bytes, unicode, oversized models) give a spec or one clean error through the CLI,
each case under a time limit and the whole under a memory limit.

Mutations: delete a token, duplicate a token, swap two numbers, insert a junk character,
truncate. Valid results are also resolved and built into the IR (which may itself only
raise SpecError)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import time_limit
from restopo.spec import SpecError, parse_spec
from restopo.spec.errors import SpecErrors

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.restopo"))
TEXTS = [p.read_text() for p in EXAMPLES]
TOKEN = re.compile(r"\s+|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|-?[0-9][0-9_.]*(?:[eE][+-]?[0-9]+)?[A-Za-z]*|.",
                   re.S)
NUMBER = re.compile(r"-?[0-9]")
JUNK = list("{}()[]:;,=#\"'@.\\/-+*\t\n\x00é€") + [
    "0", "9x", "1e", "__", "before", "window(", "1e999", "1" + "0" * 60, "-" + "9" * 5000]


@pytest.fixture(autouse=True)
def _each_under_a_time_limit():  # the mutation tests run in this process: bound them too
    with time_limit(600):
        yield


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


@st.composite
def mutated(draw):
    toks = tokens(draw(st.sampled_from(TEXTS)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["delete", "duplicate", "swap_numbers", "junk", "truncate"]))
        if not toks:
            break
        i = draw(st.integers(0, len(toks) - 1))
        if op == "delete":
            del toks[i]
        elif op == "duplicate":
            toks.insert(i, toks[i])
        elif op == "swap_numbers":
            nums = [k for k, t in enumerate(toks) if NUMBER.match(t)]
            if len(nums) >= 2:
                a, b = draw(st.sampled_from(nums)), draw(st.sampled_from(nums))
                toks[a], toks[b] = toks[b], toks[a]
        elif op == "junk":
            toks.insert(i, draw(st.sampled_from(JUNK)))
        else:
            toks = toks[:i]
    return "".join(toks)


def assert_spec_error(e: SpecError):
    errs = e.errors if isinstance(e, SpecErrors) else [e]
    for err in errs:
        assert isinstance(err.line, int) and err.line >= 1
        assert isinstance(err.column, int) and err.column >= 1
        assert err.message and "Traceback" not in err.render()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_examples_give_spec_or_spec_error(text):
    try:
        spec = parse_spec(text, "fuzz.restopo")
    except SpecError as e:
        assert_spec_error(e)
        return
    if spec.model is not None and len(spec.model.kinds) <= 512:  # a mutated depth may be huge
        try:
            g = spec.ir()
        except SpecError as e:
            assert_spec_error(e)
            return
        assert g.n_sublayers == len(spec.model.kinds)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("model{}residual()blocks:;, 0123456789x#\n=_")),
               max_size=80))
def test_random_text_gives_spec_or_spec_error(text):
    try:
        parse_spec(text)
    except SpecError as e:
        assert_spec_error(e)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30))
def test_random_overrides_give_spec_or_spec_error(override):
    try:
        parse_spec(TEXTS[0], "x.restopo", (override,))
    except SpecError as e:
        assert_spec_error(e)


# -- hostile inputs beyond mutations (tests/hostile.py) ---------------------------------------
def _hostile(tmp_path, cases: int, seed: int, limit_s: float = 30.0) -> dict:
    """Run the hostile-input driver in its own process under a 3 GiB address-space limit
    (a memory blow-up is then a MemoryError, counted, not the machine's memory)."""
    import json
    import resource
    import subprocess
    import sys

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    driver = Path(__file__).resolve().parent / "hostile.py"
    done = subprocess.run([sys.executable, str(driver), "--cases", str(cases), "--seed",
                           str(seed), "--dir", str(tmp_path / "cases"), "--limit", str(limit_s)],
                          capture_output=True, text=True, preexec_fn=cap,
                          timeout=120 + cases * limit_s / 10)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    print({k: v for k, v in summary.items() if k != "families"})
    return summary


def _assert_clean(summary: dict, cases: int) -> None:
    assert summary["cases"] == cases
    assert (summary["traceback"], summary["hang"], summary["memory"]) == (0, 0, 0), \
        summary["failures"]
    assert summary["accepted"] + summary["clean"] == cases
    assert all(f["accepted"] + f["clean"] > 0 for f in summary["families"].values())


def test_hostile_inputs_give_a_spec_or_one_clean_error(tmp_path):
    _assert_clean(_hostile(tmp_path, 300, seed=0), 300)


@pytest.mark.long
def test_hostile_inputs_many(tmp_path):
    _assert_clean(_hostile(tmp_path, 5000, seed=1), 5000)
