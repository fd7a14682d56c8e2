"""The multi-stream residuals in the language: one-liners, custom rules and overrides, and
each mistake as one located error with a hint (location, message and hint held exactly)."""
from __future__ import annotations

import pytest

from restopo import topology as T
from restopo.spec import SpecError, parse_spec

M = "model { vocab: 256; width: 64; depth: 4; heads: 4; context: 64 }\n"
SINKHORN_HINT = ("Sinkhorn-Knopp iterations per sublayer (mHC uses 20); at most 1,000: every "
                 "forward runs them all, and the backward recomputes and keeps them")

# (spec text after the model, overrides, line, column, message, hint)
ERRORS = [
    ("residual mhc\n", (), 2, 10, "mhc needs 'streams: n', the number of residual streams",
     "e.g. mhc(streams: 4): n = 4 is the papers' choice; with 1 the sublayer's output keeps "
     "a learned gate (post = 2 sigmoid)"),
    ("residual hyper_connections\n", (), 2, 10,
     "hyper_connections needs 'streams: n', the number of residual streams",
     "e.g. hyper_connections(streams: 4): n = 4 is the papers' choice; 1 is a plain residual"),
    ("residual mhc(streams: 0)\n", (), 2, 23, "'streams' must be at least 1, got 0",
     "the number of residual streams, each of width d (the papers use 1 to 8)"),
    ("residual hyper_connections(streams: 17)\n", (), 2, 37,
     "'streams' must be at most 16, got 17",
     "the number of residual streams, each of width d (the papers use 1 to 8)"),
    ("residual mhc(streams: 4, sinkhorn: 0)\n", (), 2, 36, "'sinkhorn' must be at least 1, got 0",
     SINKHORN_HINT),
    ("residual mhc(streams: 4, sinkhorn: 1001)\n", (), 2, 36,
     "'sinkhorn' must be at most 1000, got 1001", SINKHORN_HINT),
    ("residual mhc_lite(streams: 7)\n", (), 2, 28,
     "mhc_lite mixes all n! permutation matrices: streams: 7 would need 5,040 of them per "
     "sublayer",
     "use streams: 6 or fewer, or mhc(streams: 7), whose Sinkhorn projection grows as n^2"),
    ("residual mhc(streams: 4, sinkhorn: abc)\n", (), 2, 36,
     "'sinkhorn' must be a number, got 'abc'", "e.g. sinkhorn: 20"),  # its default, not 1
    ("residual mhc_light(streams: 4)\n", (), 2, 10, "unknown topology 'mhc_light'",
     "did you mean 'mhc_lite'?"),
    ("residual hyper_connection(streams: 4)\n", (), 2, 10, "unknown topology 'hyper_connection'",
     "did you mean 'hyper_connections'?"),
    ("residual mhc(stream: 4)\n", (), 2, 14, "unknown option 'stream' for mhc",
     "did you mean 'streams'?"),
    ("residual mhc(streams: 4, dynamic: true)\n", (), 2, 26,
     "option 'dynamic' does not apply to mhc",
     "'dynamic' is an option of hyper_connections; mhc takes streams or sinkhorn"),
    ("residual hyper_connections(streams: 4, dynamic: yes)\n", (), 2, 49,
     "unknown dynamic 'yes'", "expected one of: true, false"),
    ("residual custom { before sublayer: mhc(embedding; streams: 4) }\n", (), 2, 40,
     "mhc reads the n residual streams, not sources", "write mhc(streams: 4)"),
    ("residual custom { before sublayer: mhc(streams: 2, dynamic: true) }\n", (), 2, 52,
     "option 'dynamic' does not apply to mhc",
     "'dynamic' is an option of hyper_connections; mhc takes streams or sinkhorn"),
    ("residual custom { before sublayer: mhc(streams: 4; key_norm: none) }\n", (), 2, 52,
     "option 'key_norm' does not apply to mhc",
     "mhc takes streams or sinkhorn (attend takes query, gate, key_norm or heads; scalars "
     "takes gate)"),
    ("residual custom { before sublayer: mhc_lite(streams: 3; gate: sigmoid) }\n", (), 2, 57,
     "option 'gate' does not apply to mhc_lite",
     "mhc_lite takes streams (attend takes query, gate, key_norm or heads; scalars takes gate)"),
    ("residual custom { blocks: 2; before sublayer: mhc(streams: 4) }\n", (), 2, 19,
     "'blocks' does not apply to mhc: n streams replace the blocks", "remove 'blocks'"),
    ("residual custom {\n before sublayer: mhc(streams: 4)\n before head: attend(embedding) }\n",
     (), 4, 2, "with mhc the head sums the streams; it takes no rule of its own",
     "remove 'before head:'"),
    ("residual custom {\n before sublayer: sum(embedding, sublayers)\n"
     " before head: mhc_lite(streams: 2) }\n", (), 4, 2,
     "the head cannot read mhc_lite streams unless every sublayer does",
     "write 'before sublayer: mhc_lite(...)' and leave out 'before head:'"),
    ("residual mhc(streams: 4)\n", ("residual.streams=0",), 1, 24,
     "'streams' must be at least 1, got 0",
     "the number of residual streams, each of width d (the papers use 1 to 8)"),
]


@pytest.mark.parametrize("text,overrides,line,column,message,hint", ERRORS,
                         ids=[e[0].split("\n")[0][9:40] for e in ERRORS])
def test_one_located_error_with_a_hint(text, overrides, line, column, message, hint):
    with pytest.raises(SpecError) as info:
        parse_spec(M + text, "spec.restopo", overrides)
    errors = getattr(info.value, "errors", [info.value])
    assert len(errors) == 1, [str(e) for e in errors]
    e = errors[0]
    assert (e.line, e.column, e.message, e.hint) == (line, column, message, hint)
    assert e.path == ("spec.restopo" if not overrides else "<--set 1>")


def test_one_liners_resolve_to_their_topology():
    for text, method, n, extra in (
            ("hyper_connections(streams: 4)", "hyper_connections", 4, {"dynamic": False}),
            ("hyper_connections(streams: 2, dynamic: true)", "hyper_connections", 2,
             {"dynamic": True}),
            ("mhc(streams: 4)", "mhc", 4, {"sinkhorn": 20}),
            ("mhc(streams: 3, sinkhorn: 7)", "mhc", 3, {"sinkhorn": 7}),
            ("mhc_lite(streams: 6)", "mhc_lite", 6, {})):
        rule = parse_spec(M + f"residual {text}\n").topology.sublayer_rule
        assert (rule.method, rule.streams) == (method, n) and rule.sources == ()
        assert all(getattr(rule, k) == v for k, v in extra.items())


def test_overrides_reach_the_options():
    spec = parse_spec(M + "residual mhc(streams: 4)\n",
                      overrides=("residual.streams=2", "residual.sinkhorn=5"))
    rule = spec.topology.sublayer_rule
    assert (rule.streams, rule.sinkhorn) == (2, 5)
    assert spec.ir().aggregation(1).streams == 2


def test_topology_constructors_refuse_what_the_checker_refuses():
    kinds = T.sublayer_kinds(2)
    for bad in (lambda: T.mhc(kinds, 0), lambda: T.mhc_lite(kinds, 7),
                lambda: T.mhc(kinds, 4, sinkhorn=0),
                lambda: T.mhc(kinds, 4, sinkhorn=1001), lambda: T.Rule("attend", (), streams=2)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("text,n,per_sublayer", [
    ("hyper_connections(streams: 4)", 4, lambda d: 24),                      # n(n+2)
    ("hyper_connections(streams: 4, dynamic: true)", 4,
     lambda d: 2 * d + 6 * d + 24 + 2),                                      # + LN, W, s
    ("mhc(streams: 4)", 4, lambda d: 96 * d + 27),                          # nd(n^2+2n)+...
    ("mhc_lite(streams: 4)", 4, lambda d: 128 * d + 35),                    # nd(2n+n!)+...
    ("mhc(streams: 1)", 1, lambda d: 3 * d + 6),
])
def test_live_values_and_added_parameters(text, n, per_sublayer):
    """n live d-vectors per token; parameters per sublayer as ../shared/hyper.md section 6
    (the head's sum owns none), equal to what the built modules hold."""
    from restopo.api import compile as compile_spec
    from restopo.ir import added_parameters, live_values_per_token
    spec = parse_spec(M + f"residual {text}\n")
    g = spec.ir()
    assert live_values_per_token(g) == n
    assert added_parameters(g) == 8 * per_sublayer(64)
    model = compile_spec(spec, backend="eager")
    assert sum(p.numel() for p in model.aggregations.parameters()) == added_parameters(g)
