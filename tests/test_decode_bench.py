"""bench/decode.py: the timed smoke run, and its op count of one eager decoding step."""
import torch
from file_modules import bench


def _bench():
    return bench("decode")


def test_decode_bench_quick_prints_ratios(capsys):
    assert _bench().main(["--quick", "--no-compile", "--batch", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.lstrip().startswith("1 eager")]
    assert [r[2] for r in rows] == ["standard", "full", "block2", "standard'"]
    assert rows[0][4] == "1.000" and all(float(r[3]) > 0 for r in rows)


def test_decode_bench_twin_is_the_standard_model_again():
    """The noise floor's twin is a separate model with the standard one's weights."""
    b = _bench()
    ms = b.models(b.parse_args(["--quick"]))
    twin, standard = ms[b.TWIN], ms["standard"]
    assert twin is not standard
    pairs = list(zip(twin.state_dict().items(), standard.state_dict().items()))
    assert pairs and all(ka == kb and torch.equal(a, b) and a.data_ptr() != b.data_ptr()
                         for (ka, a), (kb, b) in pairs)
    assert b.TWIN not in b.models(b.parse_args(["--quick", "--no-twin"]))


def test_one_decoding_step_stays_within_its_op_budget():
    """Each op of a one-token step is a dispatch on the CPU and a kernel launch on a GPU,
    so an aggregation point's op count is its decode cost there. Budget per point, beyond
    the standard model's: 13 for Full and 14 for Block AttnRes (12 and 13.1 on torch
    2.13, the pinned one: counts follow torch's decompositions; 14 and 15.1 before the
    decoder ran under inference mode, where views are not dispatched; 30 before the stacked
    forms were trimmed, Block 17.8 before its phase 1 took one log-sum-exp and its phase 2
    one rms_norm, and Full 16 before 1/RMS took one addcmul for its scalars), and no dtype
    conversion or promotion in a float32 model. (This counts the ops Python dispatches:
    a composite such as rms_norm or logsumexp counts once and runs several inside, which
    is why phase 2 takes 1/RMS by a norm and phase 1 writes its log-sum-exp out.)"""
    bench = _bench()
    # the eager backend's forms: the budget is theirs (the cpu backend's kernels are one
    # foreign call a point, which dispatches no torch op at all)
    args = bench.parse_args(["--quick", "--backend", "eager"])
    with torch.no_grad():
        counts = bench.count_ops(args, bench.models(args), batch=1)
    points = 2 * args.depth + 1  # one aggregation point per sublayer, and the head's
    for name, budget in (("full", 13), ("block2", 14)):
        extra = counts[name] - counts["standard"]
        assert 0 < sum(extra.values()) <= budget * points, (name, extra.most_common(8))
        for op in ("promote_types", "_to_copy", "to"):
            assert counts[name][op] == 0, (name, op)
