"""The CLI foundation and the check / inspect / graph commands, through main([...]) and
once through the installed console script."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from restopo.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BLOCK = str(EXAMPLES / "block_attnres.restopo")
TINY = str(EXAMPLES / "tiny.restopo")


@pytest.fixture
def bad(tmp_path):
    p = tmp_path / "bad.restopo"
    p.write_text("model { vocab: 256; widht: 64; depth: 4; heads: 4; context: 64 }\n"
                 "residual block_attnres(blocks: 9)\n")
    return str(p)


def test_check_all_examples_ok(capsys):
    files = sorted(str(p) for p in EXAMPLES.glob("*.restopo"))
    assert main(["check", *files]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(files)
    assert all(": ok (" in line for line in out)
    line = next(x for x in out if x.startswith(BLOCK))
    assert line == f"{BLOCK}: ok (32 sublayers, topology block_attnres, 8 blocks, " \
                   "9 live values per token)"


def test_check_says_a_window_that_covers_the_depth_is_full_attnres(tmp_path, capsys):
    model = "model { vocab: 256; width: 64; depth: 4; heads: 4; context: 64 }\n"
    files = {"named": "residual full_attnres(window: 8)",
             "short": "residual full_attnres(window: 7)",
             "custom": "residual custom { before sublayer: attend(embedding, window(9)) }"}
    for name, residual in files.items():
        (tmp_path / f"{name}.restopo").write_text(model + residual)
    assert main(["check", *(str(tmp_path / f"{n}.restopo") for n in files)]) == 0
    named, short, custom = capsys.readouterr().out.splitlines()
    assert named.endswith(", window 8 covers all 8 sublayers, up to 9 sources with the "
                          "embedding: the same as full_attnres)")
    assert short.endswith("per token)")  # window 7: the head reads 7 of the 8 outputs
    assert custom.endswith("window 9 covers all 8 sublayers, up to 9 sources with the "
                           "embedding: the same as reading 'sublayers')")


def test_check_reports_every_file_and_exits_1(bad, capsys):
    assert main(["check", bad, TINY, bad]) == 1
    cap = capsys.readouterr()
    assert cap.out.splitlines() == [f"{TINY}: ok (8 sublayers, topology block_attnres, 2 blocks, "
                                    "3 live values per token)"]
    assert cap.err.count(f"{bad}:1:21: error: unknown key 'widht' in model") == 2
    assert "hint: did you mean 'width'?" in cap.err
    assert "2 of 3 files have mistakes" in cap.err
    assert "Traceback" not in cap.err
    assert main(["check", bad, TINY]) == 1  # one: 'has' (it said '1 of 2 files have')
    assert capsys.readouterr().err.endswith("\n1 of 2 files has mistakes\n")


def test_check_with_override_error_names_the_set(capsys):
    assert main(["check", TINY, "--set", "model.widht=64"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[:4] == [
        "<--set 1>:1:13: error: unknown key 'widht' in model",
        "    --set model.widht=64",
        "                ^",
        "hint: did you mean 'width'?"]


def test_check_of_several_files_says_which_one_a_set_value_fails_with(tmp_path, capsys):
    """An override that fits one file and not another: the error (all inside --set) named
    no file; a bad key was printed once per file."""
    odd = tmp_path / "t18.restopo"
    odd.write_text(Path(TINY).read_text().replace("batch: 16", "batch: 18"))
    assert main(["check", TINY, str(odd), "--set", "parallel.stages=3"]) == 1  # 3 | 18
    cap = capsys.readouterr()
    assert cap.out.startswith(f"{odd}: ok")
    assert cap.err.startswith(f"{TINY}: mistakes in the --set values, checked with this file:")
    assert main(["check", TINY, str(odd), "--set", "model.widht=64"]) == 1
    err = capsys.readouterr().err
    assert err.count("unknown key 'widht'") == 1
    assert f"{odd}: the same mistakes in the --set values as above" in err


def test_check_reads_a_spec_piped_in_as_dash():
    """`restopo check -` said '-: no such file'; it reads standard input, named <stdin>."""
    def check(data: bytes):
        return subprocess.run([sys.executable, "-m", "restopo", "check", "-"], input=data,
                              capture_output=True, timeout=120)
    text = Path(TINY).read_bytes()
    r = check(text)
    assert (r.returncode, r.stdout.decode()) == (0, "<stdin>: ok (8 sublayers, topology "
                                                 "block_attnres, 2 blocks, 3 live values per "
                                                 "token)\n")
    r = check(text.replace(b"width: 64", b"widht: 64"))
    assert r.returncode == 1 and b"<stdin>:7:15: error: unknown key 'widht' in model" in r.stderr
    r = check(b"\xff" + text)
    assert r.returncode == 1 and b"<stdin>:1:1: not UTF-8" in r.stderr
    assert b"Traceback" not in r.stderr


@pytest.mark.parametrize("argv,code,stream,text", [
    (["check", "does-not-exist.restopo"], 1, "err", "does-not-exist.restopo: no such file"),
    (["check", str(EXAMPLES)], 1, "err", "is a directory"),
    (["inspect", "does-not-exist.restopo"], 1, "err", "no such file"),
    (["check", ""], 1, "err", "restopo: error: '': no such file"),  # was: no name at all
    (["inspect", "-"], 1, "err", "'-' (standard input) is read only by restopo check"),
    (["check"], 2, "err", "usage:"),
    (["inspect", TINY, "--format", "yaml"], 2, "err", "invalid choice"),
    (["frobnicate"], 2, "err", "invalid choice"),
    ([], 2, "err", "usage:"),
    (["--version"], 0, "out", "restopo 0.1.0"),
    (["--help"], 0, "out", "examples:"),
])
def test_exit_codes(argv, code, stream, text, capsys):
    assert main(argv) == code
    cap = capsys.readouterr()
    assert text in getattr(cap, stream)
    assert "Traceback" not in cap.err


def test_binary_file_is_one_line(tmp_path, capsys):
    p = tmp_path / "x.restopo"
    p.write_bytes(b"\xff\xfe\x00model")
    assert main(["check", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "not UTF-8 text" in err and str(p) in err


def test_a_run_or_saved_model_given_for_a_spec_says_what_to_give(tmp_path, capsys):
    """`restopo train runs/tiny` said 'is a directory, not a spec file', a checkpoint folder
    the same, and a model.pt or .safetensors 'is larger than 65,536 bytes ...; is it a
    spec?' (a small one: not UTF-8): each now says what it is, and for a run folder how to
    continue its run."""
    step = tmp_path / "run" / "ckpt" / "step_000010"
    step.mkdir(parents=True)
    (tmp_path / "model.safetensors").write_bytes(b"\x08" + bytes(70000))
    (tmp_path / "small.pt").write_bytes(b"PK\x03\x04\xff")
    cases = {tmp_path / "run": "is a run folder, not a spec; give a .restopo file (restopo "
                               f"train --resume --out {tmp_path / 'run'} continues a run",
             tmp_path / "run" / "ckpt": "is a checkpoint folder, not a spec",
             step: "is a checkpoint folder, not a spec",
             tmp_path / "model.safetensors": "is a saved model, not a spec",
             tmp_path / "small.pt": "is a saved model, not a spec"}
    for path, said in cases.items():
        for command in (["train", str(path)], ["check", str(path)],
                        ["graph", str(path), "-o", str(tmp_path / "g.dot")]):
            assert main(command) == 1
            err = capsys.readouterr().err
            assert f"{path}: {said}" in err and err.count("\n") == 1, err
    # a folder that holds no run is still a directory
    assert main(["check", str(tmp_path)]) == 1
    assert "is a directory, not a spec file" in capsys.readouterr().err


@pytest.mark.parametrize("name", COMMANDS)
def test_subcommand_help_has_examples(name, capsys):
    assert main([name, "--help"]) == 0
    assert "examples:" in capsys.readouterr().out


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_says_what_it_does_and_its_real_default(name):
    """Each option of `restopo NAME --help` has a line (--device had none in four
    commands, eval's --format none), an option with a default says it, and a default the
    line gives as a number is the one argparse applies."""
    import argparse
    import re

    from restopo.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for a in sub.choices[name]._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        flag = f"restopo {name} {a.option_strings[-1]}"
        assert a.help and len(a.help.split()) >= 3, f"{flag} has no help line"
        said = re.findall(r"\bdefault:? (-?\d[\d.e+-]*)", a.help)
        if a.default not in (None, False, []):
            assert "default" in a.help, f"{flag} does not say its default {a.default!r}"
        if isinstance(a.default, (int, float)) and not isinstance(a.default, bool):
            assert said, f"{flag} does not give its default {a.default}"
        for value in said:  # None: the command's code applies the default said
            assert a.default is None or float(value) == a.default, (flag, value, a.default)


def test_inspect_json_shape(capsys):
    assert main(["inspect", BLOCK, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("sublayers", "blocks", "live_values_per_token", "added_parameters",
                "aggregations"):
        assert key in data
    assert (data["sublayers"], data["blocks"], data["live_values_per_token"]) == (32, 8, 9)
    aggs = data["aggregations"]
    assert [a["index"] for a in aggs] == list(range(1, 34))
    assert aggs[0] == {**aggs[0], "before": "attn", "sources": ["embedding"]}
    assert aggs[5]["before"] == "mlp" and aggs[5]["sources"] == ["embedding", "block1", "partial"]
    assert aggs[-1]["before"] == "head"
    assert aggs[-1]["sources"] == ["embedding"] + [f"block{n}" for n in range(1, 9)]
    # 33 aggregation points x (pseudo-query + key-norm gain) of width 64
    assert data["added_parameters"] == 33 * 2 * 64


def test_inspect_help_names_every_key_of_its_json(capsys):
    """`inspect --help` lists the JSON's keys; it had left out six of them (spec, topology,
    model, block_sizes, two_phase_groups and pipeline)."""
    import re
    assert main(["inspect", BLOCK, "--format", "json", "--pipeline", "2x2"]) == 0
    keys = set(json.loads(capsys.readouterr().out))
    assert main(["inspect", "--help"]) == 0
    text = capsys.readouterr().out
    said = set(re.findall(r"\w+", text[text.index("JSON has the keys"):]))
    assert keys <= said, sorted(keys - said)


def test_inspect_help_names_every_row_of_its_table(capsys):
    """The description named blocks, live values, added parameters and the two-phase plan,
    not the parameters in all, the FLOPs per token or the residual I/O the table shows."""
    assert main(["inspect", BLOCK]) == 0
    import re
    rows = [re.split(r"\s{2,}", line.strip())[0] for line in capsys.readouterr().out.splitlines()
            if re.match(r"  [a-zA-Z]", line)]  # the summary, and the aggregations' header
    assert "FLOPs per token" in rows and "residual I/O" in rows and rows[-1] == "point"
    assert main(["inspect", "--help"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert not [row for row in rows[:-1] if row not in said], rows


def test_inspect_text_table_and_overrides(capsys):
    assert main(["inspect", TINY, "--set", "residual=full_attnres"]) == 0
    out = capsys.readouterr().out
    assert "full_attnres, 8 sublayers" in out
    assert "live values per token  9" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows[0][:3] == ["1", "attn", "attend"]
    assert rows[-1][:3] == ["9", "head", "attend"]
    assert out.rstrip().endswith("(9) embedding, sublayer1..sublayer8")


def test_pipeline_p_alone_is_px1_and_both_helps_say_so(capsys):
    """`--pipeline 3` is 3x1 in inspect and train alike (parse_pv), which their help, saying
    only PxV, did not tell; both helps now say it."""
    spec = "examples/block_attnres.restopo"
    assert main(["inspect", spec, "--format", "json", "--pipeline", "3"]) == 0
    alone = json.loads(capsys.readouterr().out)["pipeline"]
    assert main(["inspect", spec, "--format", "json", "--pipeline", "3x1"]) == 0
    assert alone == json.loads(capsys.readouterr().out)["pipeline"]
    for command in ("inspect", "train"):
        assert main([command, "--help"]) == 0
        assert "(P alone: Px1" in " ".join(capsys.readouterr().out.split())


def test_inspect_shows_the_scalars_gate(capsys):
    """The static-scalars ablation and DenseFormer differ only in their gate: inspect says so."""
    assert main(["inspect", str(EXAMPLES / "full_scalars.restopo"), "--format", "json"]) == 0
    soft = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(EXAMPLES / "denseformer.restopo"), "--format", "json"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert {a["gate"] for a in soft["aggregations"]} == {"softmax"}
    assert {a["gate"] for a in dense["aggregations"]} == {"none"}
    assert soft["added_parameters"] == dense["added_parameters"] == sum(range(1, 34))
    assert main(["inspect", str(EXAMPLES / "full_scalars.restopo")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip()[:1].isdigit()]
    assert rows[0][:5] == ["1", "attn", "scalars", "gate", "softmax"]


def test_inspect_residual_only_spec_is_a_spec_error(tmp_path, capsys):
    p = tmp_path / "r.restopo"
    p.write_text("residual full_attnres\n")
    assert main(["inspect", str(p)]) == 1
    err = capsys.readouterr().err
    assert f"{p}:1:10: error: the IR needs a model section" in err
    assert main(["check", str(p)]) == 0
    assert "residual full_attnres only" in capsys.readouterr().out


def test_graph_writes_dot(tmp_path, capsys):
    out = tmp_path / "g.dot"
    assert main(["graph", TINY, "-o", str(out)]) == 0
    dot = out.read_text()
    assert dot.startswith('digraph "restopo" {') and dot.rstrip().endswith("}")
    assert dot.count("subgraph \"cluster_block") == 2 and '"cluster_head"' in dot
    # agg6 (block 2's second point) reads the completed embedding and block1 through
    # block 2's phase 1, and its partial p_2^2, which is sublayer5 itself (as in model.code)
    for edge in ('"embedding" -> "block2_phase1"', '"block1" -> "block2_phase1"',
                 '"block2_phase1" -> "agg6"', '"sublayer5" -> "agg6"', '"agg9" -> "head"'):
        assert edge in dot
    for src in ("embedding", "block1", "block2"):  # the head reads every block
        assert f'"{src}" -> "agg9"' in dot
    assert "partial2.2" not in dot and 'label="partial2_3' in dot
    assert [p.name for p in tmp_path.iterdir()] == ["g.dot"]  # no temporary left behind


@pytest.mark.parametrize("engine", ["matplotlib"] + (["graphviz"] if shutil.which("dot") else []))
@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<")])
def test_graph_writes_pictures(tmp_path, engine, suffix, magic):
    out = tmp_path / f"g{suffix}"
    assert main(["graph", TINY, "-o", str(out), "--engine", engine]) == 0
    data = out.read_bytes()
    assert data.startswith(magic) or (suffix == ".svg" and b"<svg" in data[:400])
    assert len(data) > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_graph_bad_suffix_is_usage_error(tmp_path, capsys):
    """Said as compile's and export's are, with the formats as a sentence says them (it was
    'cannot write ...: the output must end in .dot, .gv, .png, .svg')."""
    out = str(tmp_path / "g.pdf")
    assert main(["graph", TINY, "-o", out]) == 2
    assert capsys.readouterr().err == (f"restopo graph: error: -o must end in .dot, .gv, .png "
                                       f"or .svg; got {out!r}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ["graphviz", "matplotlib"])
def test_graph_engine_for_dot_text_is_refused(tmp_path, capsys, engine):
    # an engine draws; .dot is text: the flag would be ignored (or, for graphviz without the
    # dot program, refused for a program the text does not need)
    assert main(["graph", TINY, "-o", str(tmp_path / "g.dot"), "--engine", engine]) == 2
    assert f"--engine {engine} draws .png and .svg" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_graph_spec_error_leaves_no_file(tmp_path, bad, capsys):
    out = tmp_path / "g.png"
    assert main(["graph", bad, "-o", str(out)]) == 1
    assert not out.exists()


def test_console_script_subprocess(bad):
    exe = shutil.which("restopo")
    cmd = [exe] if exe else [sys.executable, "-m", "restopo"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run(cmd + ["check", TINY], capture_output=True, text=True, timeout=120,
                        env=env)
    assert ok.returncode == 0 and ": ok (" in ok.stdout
    err = subprocess.run(cmd + ["check", bad], capture_output=True, text=True, timeout=120,
                         env=env)
    assert err.returncode == 1 and "Traceback" not in err.stderr
    assert "error: unknown key 'widht'" in err.stderr
    usage = subprocess.run(cmd + ["inspect"], capture_output=True, text=True, timeout=120,
                           env=env)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    mod = subprocess.run([sys.executable, "-m", "restopo", "--version"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert mod.returncode == 0 and mod.stdout.startswith("restopo ")


def test_a_command_that_cannot_import_is_reported_not_raised(monkeypatch, capsys):
    import restopo.cli as cli
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + ("nosuchcommand",))
    assert cli.main(["check", TINY]) == 0          # the others still work
    assert cli.main(["nosuchcommand", "x"]) == 1
    err = capsys.readouterr().err
    assert "restopo nosuchcommand: unavailable here" in err and "Traceback" not in err


def test_graph_falls_back_when_dot_fails(tmp_path, monkeypatch, capsys):
    """A broken Graphviz install still gives a picture (auto) or a one-line error."""
    import restopo.commands.graph as graph
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'dot: broken' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "g.png"
    assert graph.shutil.which("dot") == str(fake)
    assert main(["graph", TINY, "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "dot failed (dot: broken); drawing with matplotlib" in capsys.readouterr().err
    out.unlink()
    assert main(["graph", TINY, "-o", str(out), "--engine", "graphviz"]) == 1
    assert "dot failed: dot: broken" in capsys.readouterr().err and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


def test_text_that_is_not_utf8_is_placed_by_line_and_column(tmp_path, capsys):
    p = tmp_path / "latin1.restopo"
    p.write_bytes("# spec\nmodel { vocab: 256 }\n# caf\u00e9\n".encode("latin-1"))
    assert main(["check", str(p)]) == 1
    err = capsys.readouterr().err
    assert f"{p}:3:6: not UTF-8 text (byte 0xe9)" in err


def test_an_extra_argument_is_said_with_the_commands_own_usage(capsys):
    """`restopo inspect A B` printed the top level's usage, which does not show FILE."""
    assert main(["inspect", str(ROOT / "examples" / "tiny.restopo"), "extra.restopo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: restopo inspect") and \
        "restopo inspect: error: unrecognized arguments: extra.restopo" in err, err
    assert main(["--bogus"]) == 2
    assert "restopo: error: unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "inspect", "graph", "compile", "train", "sweep"])
def test_a_key_set_twice_is_a_usage_error_naming_both_values(command, tmp_path, capsys):
    """`--set model.width=32 --set model.width=64` used the last silently."""
    out = tmp_path / "out"
    where = {"graph": ["-o", f"{out}.dot"], "compile": ["-o", f"{out}.pt"],
             "train": ["--out", str(out)], "sweep": ["--out", str(out)]}.get(command, [])
    assert main([command, TINY, *where, "--set", "model.width=32", "--set", "model.depth=4",
                 "--set", " model.width = 64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: restopo {command}"), err
    assert (f"restopo {command}: error: argument --set: model.width is set twice, to 32 and "
            "to 64; give it once") in err, err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_a_key_set_twice_is_told_in_any_spelling_and_other_keys_are_not(capsys):
    """`before_head` is `before head` (the command line's spelling of the key)."""
    assert main(["check", TINY, "--set", "residual.before_head=sum(embedding, sublayers)",
                 "--set", "residual.before head=sum(embedding)"]) == 2
    assert "residual.before head is set twice" in capsys.readouterr().err
    assert main(["check", TINY, "--set", "model.width=64", "--set", "model.depth=4",
                 "--set", "residual=standard", "--set", "residual.blocks=2"]) in (0, 1)
    assert "set twice" not in capsys.readouterr().err
    # two ways of one setting: the blocks by count and by size (the later replaced the
    # earlier: 16 blocks of 2 where 4 were asked for too)
    assert main(["check", TINY, "--set", "residual.blocks=4", "--set",
                 "residual.block_size=2"]) == 2
    assert ("residual.blocks=4 and residual.block_size=2 set one thing; give one of them"
            in capsys.readouterr().err)


def test_check_reports_a_data_path_that_is_not_there_where_train_looks(tmp_path, monkeypatch,
                                                                       capsys):
    """check passed a spec whose train.data names nothing; train then refused it. A path
    in the file is read from the file's folder, one given by --set from the current one."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "corpus.txt").write_text("text " * 100)
    spec = folder / "t.restopo"
    spec.write_text(Path(TINY).read_text().replace("builtin:stdlib", '"corpus.txt"'))
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(spec), "--set", "train.data=specs/corpus.txt"]) == 0
    assert main(["check", str(spec)]) == 0
    capsys.readouterr()
    spec.write_text(Path(TINY).read_text().replace("builtin:stdlib", '"missing.txt"'))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:14:9: error: data path "
                          f"'{(folder / 'missing.txt').resolve()}' does not exist"), err
    assert '    data: "missing.txt"' in err and "Traceback" not in err
    assert main(["check", str(spec), "--set", "train.data=corpus.txt"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"<--set 1>:1:18: error: data path "
                          f"'{tmp_path.resolve() / 'corpus.txt'}' does not exist"), err


@pytest.mark.parametrize("files, source", [
    ({"corpus.txt.gz": b"\x1f\x8b\x08\x00" + b"\0" * 64}, "corpus.txt.gz"),
    ({"empty.txt": b""}, "empty.txt"), ({"odd.bin": b"abc"}, "odd.bin"),
    ({"ids/train.bin": b"abc", "ids/val.bin": b"ab"}, "ids"), ({"ids/train.bin": b"ab"}, "ids")],
    ids=["binary", "empty", "odd_bin", "odd_train_bin", "no_val_bin"])
def test_check_refuses_a_data_file_train_refuses_on_its_first_bytes(tmp_path, capsys, files,
                                                                  source):
    """check passed a spec whose train.data was a binary file (a .gz given as text), an
    empty file or a .bin of an odd number of bytes (alone or a folder's train.bin), or a
    folder of train.bin without val.bin, each refused only when train read it; check now
    says what train says, at the data line."""
    from restopo.train.data import DataError, open_corpus
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    spec = tmp_path / "t.restopo"
    spec.write_text(Path(TINY).read_text().replace("builtin:stdlib", f'"{source}"'))
    with pytest.raises(DataError) as refused:
        open_corpus(source, base_dir=tmp_path)
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:14:9: error: {refused.value}\n"), err
    assert "Traceback" not in err
    for name in {**files, **({"ids/val.bin": b""} if source == "ids" else {})}:
        (tmp_path / name).write_bytes(b"plain text\n" * 10)  # even, so a .bin of it reads
    assert main(["check", str(spec)]) == 0


def test_a_data_path_in_an_unknown_home_folder_is_said_not_a_traceback(tmp_path, capsys):
    """data: "~nosuchuser/x.txt" ended check and train in a RuntimeError traceback (pathlib
    cannot expand the ~ of a user this machine does not know); both now say so."""
    from restopo.train.data import DataError, open_corpus
    source = "~restopo_no_such_user_q7/x.txt"
    spec = tmp_path / "t.restopo"
    spec.write_text(Path(TINY).read_text().replace("builtin:stdlib", f'"{source}"'))
    with pytest.raises(DataError) as refused:
        open_corpus(source, base_dir=tmp_path)
    assert refused.value.missing and "a home folder this machine does not know" in str(
        refused.value)
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:14:9: error: {refused.value}\n"), err


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.restopo")))
@pytest.mark.parametrize("overrides", [(), ("model.tie_embeddings=false", "model.mlp=gelu(3x)")])
def test_inspect_counts_the_compiled_models_parameters(example, overrides, capsys):
    """inspect gave the topology's added parameters but no total; its total, embedding and
    non-embedding counts are the compiled model's (a tied LM head's table counted once).
    check's parameter bound counts the same way (it took SwiGLU's hidden width as ratio x d
    and left the norms out)."""
    from restopo.api import compile
    from restopo.spec import load_spec
    from restopo.spec.limits import parameters
    args = [a for o in overrides for a in ("--set", o)]
    assert main(["inspect", str(EXAMPLES / example), "--format", "json", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    got = report["parameters"]
    spec = load_spec(EXAMPLES / example, overrides)
    model = compile(spec, backend="eager")
    tables = {id(w): w.numel() for w in (model.get_submodule("embed").weight,
                                         model.get_submodule("head.lm_head").weight)}
    assert got["total"] == sum(p.numel() for p in model.parameters())
    assert got["embedding"] == sum(tables.values())
    assert got["non_embedding"] == got["total"] - got["embedding"]
    assert parameters(spec.model) == got["total"] - report["added_parameters"]
    assert main(["inspect", str(EXAMPLES / example), *args]) == 0
    assert f"parameters             {got['total']:,} (" in capsys.readouterr().out
