"""Bounded input (issue 16, #5 and #6): a spec path is read only if it is a regular file
under the size cap, nesting is bounded before the recursive parse, errors are reported in
linear time, `check` refuses what `train` cannot run (with the reason), and the IR of a
fixed number of blocks is linear in depth. Every case runs under a time limit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostile import BASE, time_limit
from restopo.cli import main
from restopo.spec import MAX_SPEC_BYTES, SpecError, parse_spec
from restopo.spec.check import MAX_REPORTED
from restopo.spec.limits import MAX_SOURCE_READS
from restopo.spec.nodes import Pos
from restopo.spec.objects import SourceText

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.restopo"))


@pytest.fixture(autouse=True)
def _each_under_a_time_limit():
    with time_limit(600):
        yield


def _cli_error(argv, capsys, limit=60) -> str:
    with time_limit(limit):
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _special_paths(tmp_path):
    fifo = tmp_path / "fifo.restopo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.restopo"
    os.symlink(tmp_path / "loop2.restopo", loop)
    os.symlink(loop, tmp_path / "loop2.restopo")
    big = tmp_path / "big.restopo"
    big.write_text("#" * (MAX_SPEC_BYTES + 1))
    return {"fifo": (fifo, "named pipe"), "zero": ("/dev/zero", "character device"),
            "folder": (tmp_path, "is a directory"), "loop": (loop, "symbolic links"),
            "mem": ("/proc/self/mem", "Input/output error"),
            "long": (tmp_path / ("n" * 300 + ".restopo"), "too long"),
            "big": (big, f"larger than {MAX_SPEC_BYTES:,} bytes")}


@pytest.mark.parametrize("command", ["check", "inspect", "compile", "train"])
def test_paths_that_are_not_spec_files_are_one_line(command, tmp_path, capsys):
    extra = {"compile": ["-o", str(tmp_path / "m.py")], "train": ["--out", str(tmp_path / "r")]}
    for name, (path, words) in _special_paths(tmp_path).items():
        err = _cli_error([command, str(path), *extra.get(command, [])], capsys)
        assert words in err and "no such spec file" not in err, (name, err)
    assert not (tmp_path / "m.py").exists()


def test_deep_nesting_is_a_spec_error_not_a_recursion_error(capsys, tmp_path):
    for n in (17, 165, 100_000):
        text = BASE + "residual " + "f(" * n + "x" + ")" * n + "\n"
        with time_limit(30), pytest.raises(SpecError, match="nested too deeply"):
            parse_spec(text)
        with time_limit(30), pytest.raises(SpecError, match="nested too deeply"):
            parse_spec(BASE + "residual standard\n", overrides=("residual=" + "f(" * n,))
    spec = tmp_path / "deep.restopo"
    spec.write_text(BASE + "residual " + "f(" * 165 + "x" + ")" * 165 + "\n")
    err = capsys.readouterr().err
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "deep.restopo:2:" in err and "nested too deeply" in err and "Traceback" not in err
    # the shown line is cut around the caret, not printed whole
    assert max(len(line) for line in err.splitlines()) < 200


def test_nesting_inside_comments_and_strings_does_not_count():
    text = BASE + "# " + "(" * 100 + "\nresidual standard\ntrain { data: \"" + "{" * 100 + "\" }\n"
    assert parse_spec(text).train.data == "{" * 100


class CountingText(str):
    splits = 0

    def split(self, *args):
        CountingText.splits += 1
        return super().split(*args)


def test_source_lines_are_split_once_for_any_number_of_errors():
    src = SourceText({"f": CountingText("a\nb\nc\n" * 1000)})
    for line in range(1, 3001):
        assert src.line(Pos("f", line, 1)) == "abc"[(line - 1) % 3]
    assert CountingText.splits == 1


class LongLine(str):
    """A source line that counts the characters its tabs are expanded over."""
    expanded = 0

    def expandtabs(self, *args):
        LongLine.expanded += len(self)
        return super().expandtabs(*args)


def test_an_error_on_a_long_line_renders_only_the_part_shown():
    """Every error on a long line (a one-line call with a key given 20,000 times) expanded
    the tabs of the whole line, though only SHOWN_LINE characters are shown: the errors of
    one line took time quadratic in its length (4.7 s for 20,000 repeated keys, 2.0 s now)."""
    from restopo.spec.errors import SHOWN_LINE
    line = LongLine("x\t" * 500_000)
    for column in (1, 500_000, 1_000_000):
        rendered = SpecError("f", 1, column, "m", None, line).render().splitlines()
        assert len(rendered[1]) <= SHOWN_LINE + 10 and "\t" not in rendered[1]
        assert rendered[2].index("^") - 4 <= SHOWN_LINE + 3
    assert LongLine.expanded <= 3 * SHOWN_LINE


def test_many_errors_are_reported_in_one_pass_and_capped(tmp_path, capsys):
    n = (MAX_SPEC_BYTES - 200) // 12  # unknown keys up to the size cap
    spec = tmp_path / "keys.restopo"
    spec.write_text("model m {\n" + "".join(f"k{i:07d}: 1\n" for i in range(n)) + "}\n"
                    "residual standard\n")
    assert spec.stat().st_size <= MAX_SPEC_BYTES
    with time_limit(120):  # quadratic reporting took minutes at this size
        code = main(["check", str(spec)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count(": error: ") == MAX_REPORTED + 1
    assert f"and {n - MAX_REPORTED + 5:,} more errors" in err  # + the 5 missing model keys


@pytest.mark.parametrize("override, words", [
    ("train.batch=100000000", "tokens, more than 16,777,216"),
    ("train.eval_batches=100000", "validation would keep"),
    ("train.accum=3", "accum (3) must divide batch (16)"),
    ("model.context=1000000", "'context' is at most 131,072"),
    ("model.width=1000000", "parameters, more than"),
    ("model.depth=4097", "must be at most 4096"),
    # a bound added with multi-stream residuals: every forward runs all the iterations and
    # the backward keeps two tensors per iteration (1e9 was accepted and never finished a step)
    ("residual=mhc(streams: 4, sinkhorn: 1000000000)", "'sinkhorn' must be at most 1000"),
    # a pipeline's microbatches cut the batch: check passed 10^9, which train refused
    ("parallel=pipeline(stages: 2, microbatches: 1000000000)",
     "microbatches (1000000000) must divide train.batch (16)"),
    ("parallel=pipeline(stages: 3)", "stages (3), the number of microbatches when none is "
                                     "given, must divide train.batch (16)"),
])
def test_check_refuses_what_train_cannot_run(override, words, capsys):
    with time_limit(60):
        code = main(["check", str(ROOT / "examples" / "tiny.restopo"), "--set", override])
    err = capsys.readouterr().err
    assert code == 1 and words in err and "<--set 1>:1:" in err and "hint: " in err, err


def test_source_reads_bound_full_attnres_by_its_reads(capsys):
    spec = str(ROOT / "examples" / "full_attnres.restopo")
    with time_limit(60):
        assert main(["check", spec, "--set", "model.depth=4096"]) == 1
    err = capsys.readouterr().err
    assert f"more than {MAX_SOURCE_READS:,}" in err and "Block AttnRes" in err
    with time_limit(60):  # a window keeps the reads linear: accepted at the largest depth
        assert main(["check", spec, "--set", "model.depth=4096",
                     "--set", "residual=full_attnres(window: 4)"]) == 0
    capsys.readouterr()
    with time_limit(60):  # a standard residual past the bound is offered only a smaller depth
        assert main(["check", str(ROOT / "examples" / "standard.restopo"),
                     "--set", "model.depth=4096"]) == 1
    err = capsys.readouterr().err
    assert "use a smaller depth" in err and "window" not in err and "Block" not in err, err


def test_source_reads_counts_what_the_ir_reads():
    from restopo.ir.build import source_reads
    for path in EXAMPLES:
        for v in ("model.depth=8", "model.depth=16"):
            spec = parse_spec(path.read_text(), str(path), (v,))
            g = spec.ir()
            assert source_reads(spec.model.kinds, spec.topology) == sum(
                len(a.sources) for a in g.aggregations()), (path.name, v)


@pytest.mark.parametrize("topology", ["block_attnres(blocks: 2)", "block_attnres(blocks: 8)",
                                      "full_attnres(window: 4)", "standard"])
def test_ir_of_fixed_block_count_is_linear_in_depth(topology):
    """Partial sums cost two edges each (before: a block of S sublayers had S^2/2 partial-sum
    edges; a standard residual is one block of all L). Whatever reads a fixed number of
    sources per point has a linear IR; `standard` reads every earlier output (L^2/2 reads,
    bounded by limits.MAX_SOURCE_READS) but its partial sums are linear too."""
    for depth in (64, 128, 256):
        spec = parse_spec(BASE.replace("depth: 2", f"depth: {depth}") + f"residual {topology}\n")
        g = spec.ir()
        partial_edges = sum(1 for u, v in g.edges if v.startswith("partial"))
        assert partial_edges <= 2 * g.n_sublayers, (depth, partial_edges)  # was ~L^2/(2N)
        if topology != "standard":
            assert g.number_of_edges() <= 16 * g.n_sublayers, (depth, g.number_of_edges())


@pytest.mark.slow
def test_depth_4096_block_attnres_checks_in_a_subprocess_under_a_limit(tmp_path):
    """`restopo check` at the largest depth, in its own process with 2 GiB of address space
    (before: minutes, then MemoryError)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    done = subprocess.run([sys.executable, "-m", "restopo", "check",
                           str(ROOT / "examples" / "tiny.restopo"), "--set", "model.depth=4096"],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8,192 sublayers" in done.stdout  # 2 x 4096, counted as counts are said


def test_compile_into_a_missing_folder_names_the_folder(tmp_path, capsys):
    err = _cli_error(["compile", str(ROOT / "examples" / "tiny.restopo"), "-o",
                      str(tmp_path / "nowhere" / "m.pt")], capsys, limit=120)
    assert f"{tmp_path / 'nowhere' / 'm.pt'}: the folder to write it in does not exist" in err
    assert ".restopo-" not in err


@pytest.mark.parametrize("override, at", [
    ("model.mlp=swiglu(100000000x)", "swiglu("),   # the MLPs' hidden width makes them
    ("model.vocab=1000000000", "1000000000"),        # the embedding does
    ("model.width=1000000", "1000000")])
def test_too_many_parameters_points_at_what_makes_them(override, at, capsys):
    assert main(["check", str(ROOT / "examples" / "tiny.restopo"), "--set", override]) == 1
    lines = capsys.readouterr().err.splitlines()
    head = next(i for i, ln in enumerate(lines) if "parameters, more than" in ln)
    source, caret = lines[head + 1], lines[head + 2]
    assert source[caret.index("^"):].startswith(at), (source, caret)
