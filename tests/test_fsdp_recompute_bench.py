"""bench/fsdp_recompute.py: what activation recompute gathers under FSDP, counted in the
workers of real `restopo train` runs (CI-size smoke: a tiny model, 3 steps)."""
import pytest
from file_modules import bench as load_bench

pytestmark = pytest.mark.slow


def test_block_recompute_gathers_no_more_under_fsdp():
    """FSDP2 gathers each unit once in forward and once in backward; a `block` region's
    forward, run again inside backward, runs where its units are gathered for backward
    anyway, so a step gathers what it gathers without recompute (one process, nothing)."""
    bench = load_bench("fsdp_recompute")
    args = bench.parse_args(["--quick"])
    got = bench.measure(args)
    rows = {key: runs[-1] for key, runs in got.items()}
    assert rows[("1", "none")]["gathers"] == rows[("1", "block")]["gathers"] == 0
    none, block = rows[("fsdp", "none")], rows[("fsdp", "block")]
    # 4 sublayer units and the root: 5 gathers forward, 4 backward (the root stays whole)
    assert none["gathers"] == 9
    assert (block["gathers"], block["gather_bytes"]) == (none["gathers"], none["gather_bytes"])
    assert all(r["step"] > 0 for r in rows.values())
    lines = bench.table(args, got).splitlines()
    table = [line.split() for line in lines if line.startswith(("1 proc", "fsdp2"))]
    assert [(r[0], r[2] if r[0] == "1" else r[1]) for r in table] == [
        ("1", "none"), ("1", "block"), ("fsdp2", "none"), ("fsdp2", "block")]
    assert table[3][4] == "1.000"  # block's gathered bytes x none
