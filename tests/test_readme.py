"""Every code block of README.md runs or checks as shown: Python blocks run, spec blocks
parse and check, shell lines name real commands, options and files, and the `restopo check`
transcript is what the command prints. The commands in docs/*.md parse too, each table there
names the command that wrote it, and the README's Experiments commands remake
docs/results.md."""
import argparse
import os
import re
import shlex
from pathlib import Path

import pytest

from restopo.cli import build_parser, main
from restopo.spec import parse_spec

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MODEL = "model m { vocab: 256; width: 64; depth: 8; heads: 4; context: 64 }\n"


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall((ROOT / "README.md").read_text())
            if lang == language]


def test_every_block_says_its_language():
    langs = {lang for lang, _ in FENCE.findall((ROOT / "README.md").read_text())}
    assert "" not in langs and langs <= {"sh", "python", "restopo", "text"}


@pytest.mark.parametrize("k", range(len(blocks("python"))))
def test_python_blocks_run(k, tmp_path, monkeypatch):
    source = blocks("python")[k]
    if "transformers" in source:
        pytest.importorskip("transformers")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    exec(compile(source, f"README.md python block {k + 1}", "exec"), {"__name__": "readme"})


def _specs(block: str) -> list[str]:
    """Whole specs to check: a block of one-line `residual` rules is one spec per line."""
    lines = [ln for ln in block.splitlines() if ln.strip()]
    if len(lines) > 1 and all(ln.startswith("residual ") for ln in lines):
        return [MODEL + ln + "\n" for ln in lines]
    text = block if "model " in block else MODEL + block
    return [text if "residual" in text else text + "residual standard\n"]


def test_spec_blocks_check():
    found = blocks("restopo")
    assert found
    for block in found:
        for text in _specs(block):
            spec = parse_spec(text, path="README.md")  # raises SpecError with the place
            assert spec.model is not None


def test_the_tour_shows_the_tiny_example_as_it_is():
    tour = [b for b in blocks("restopo") if b.startswith("# The smallest useful spec")]
    assert tour == [(ROOT / "examples/tiny.restopo").read_text()]


def test_shell_lines_name_real_commands_options_and_files(monkeypatch):
    monkeypatch.chdir(ROOT)
    parser = build_parser()
    seen = 0
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():  # continuations joined
            for command in line.split("&&"):
                argv = shlex.split(command.split("#")[0])
                if argv[:1] == ["restopo"]:
                    args = parser.parse_args(argv[1:])  # SystemExit on a bad option
                    spec = getattr(args, "spec", None)
                    assert spec is None or (ROOT / spec).is_file(), spec
                    seen += 1
                elif argv[:1] == ["python"] and argv[1].endswith(".py"):
                    assert (ROOT / argv[1]).is_file(), argv[1]
    assert seen >= 4


def test_the_cli_table_names_every_command():
    """The README's table of commands lists each one the CLI has, and no other."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## The CLI"):]
    table = table[:table.index("\n\n", table.index("| command |"))]
    listed = re.findall(r"^\| `restopo (\w+)", table, re.M)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(listed) == sorted(sub.choices)


def test_check_transcript(tmp_path, monkeypatch, capsys):
    (block,) = [b for b in blocks("text") if b.startswith("$ restopo check")]
    first, *want = block.rstrip("\n").splitlines()
    argv = shlex.split(first[2:])
    bad = tmp_path / argv[-1]
    source = want[1].strip()  # the offending line as the error shows it
    line = int(want[0].split(":")[1])
    bad.write_text("".join(MODEL if i == 0 else "\n" for i in range(line - 1)) + source + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 1
    assert capsys.readouterr().err.rstrip("\n").splitlines() == want


def _commands(path: Path) -> list[list[str]]:
    """The `restopo ...` lines of a file's sh blocks as argv (continuations joined, comments
    dropped, globs expanded from the repository root as a shell in it would)."""
    out = []
    for lang, body in FENCE.findall(path.read_text()):
        for line in body.replace("\\\n", " ").splitlines() if lang == "sh" else ():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["restopo"]:
                out.append([x for a in argv for x in (sorted(
                    str(p.relative_to(ROOT)) for p in ROOT.glob(a)) if "*" in a else [a])])
    return out


def _results_made_by() -> set[tuple[str, tuple[str, ...], int]]:
    """(spec, --set overrides, seed) of every run docs/results.md says it was made from: its
    `restopo train SPEC --set ... --seed S   # arm: S = 0, 1, 2` lines."""
    text = (ROOT / "docs" / "results.md").read_text()
    made = set()
    for line in re.findall(r"^restopo train .*$", text, re.M):
        command, _, seeds = line.partition("#")
        argv = shlex.split(command)
        sets = tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--set")
        for seed in seeds.partition("S = ")[2].split(","):
            made.add((argv[2], sets, int(seed)))
    return made


def test_docs_commands_parse_and_name_real_files():
    """Every `restopo ...` line in docs/*.md is one the CLI takes (a run's `--seed S` with a
    seed in place of S), and the specs it names are in the repository."""
    parser = build_parser()
    seen = 0
    for path in sorted((ROOT / "docs").glob("*.md")):
        for argv in _commands(path):
            argv = ["0" if a == "S" and argv[i - 1] == "--seed" else a
                    for i, a in enumerate(argv)]
            args = parser.parse_args(argv[1:])  # SystemExit on a bad option
            for spec in [getattr(args, "spec", None), *getattr(args, "specs", [])]:
                assert spec is None or (ROOT / spec).is_file(), (path.name, spec)
            seen += 1
    assert seen >= 2


def test_docs_tables_name_the_command_that_wrote_them():
    """A docs/*.md with a table says which command wrote it, with the command beside it,
    and writes its output to docs/ (where the file is)."""
    parser = build_parser()
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        if not re.search(r"^\|.*\|$", text, re.M):
            continue
        assert "regenerate it with:" in text.split("\n## ")[0], path.name
        args = parser.parse_args(_commands(path)[0][1:])
        assert os.path.normpath(args.out) == "docs", (path.name, args.out)


def test_readme_experiments_remake_docs_results():
    """The README's Experiments commands make docs/results.md as it is: its compare line is
    the one at the file's top (it had no --title, so it wrote another heading), and its
    sweeps train exactly the runs the file lists."""
    from restopo.experiments.grid import make_grid

    parser = build_parser()
    def given(argv):  # what the flags say, without the parser's own entries
        args = vars(parser.parse_args(argv[1:]))
        return {k: v for k, v in args.items() if k not in ("func", "command_parsers")}

    readme = [given(a) for a in _commands(ROOT / "README.md")]
    top = given(_commands(ROOT / "docs" / "results.md")[0])
    assert top["command"] == "compare"
    assert [a for a in readme if a["command"] == "compare" and a["out"] == "docs"] == [top]
    readme = [argparse.Namespace(**a) for a in readme]
    top = argparse.Namespace(**top)
    made = set()
    for a in readme:
        if a.command == "sweep" and os.path.normpath(a.out) in top.runs:
            seeds = [int(s) for s in a.seed_list.split(",")] if a.seed_list else \
                list(range(a.seeds or 1))
            made |= {(j.spec, j.overrides, j.seed)
                     for j in make_grid(a.specs, seeds, a.overrides, a.vary)}
    assert made == _results_made_by()


# stand-ins for the README's CLI table's placeholders, each a value its option takes
PLACEHOLDERS = {"FILE": "x.restopo", "SPEC": "x.restopo", "CHECKPOINT": "runs/x", "CKPT": "runs/x",
                "RUN": "runs/x", "PxV": "2x1", "N": "2", "J": "2", "k=v": "model.width=32",
                "k=v1,v2": "model.width=32,48", "TEXT": "t", "SOURCE": "t.txt", "OUT": "o.pt",
                "ARM": "a", "DIR": "d"}


def test_the_cli_table_synopses_are_what_the_commands_take():
    """Each command's synopsis in the README's table parses with its [optional] parts and
    without them (`sweep SPEC... --seeds N` left out the --out it requires)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| command |"):]
    parser = build_parser()
    for synopsis in re.findall(r"^\| `(restopo [^`]+)` \|", table[:table.index("\n\n")], re.M):
        words = []
        for w in synopsis.split()[1:]:  # [--nproc N] -> [--nproc 2]
            core = w.strip("[]").removesuffix("...")
            words.append(w.replace(w.strip("[]"), PLACEHOLDERS.get(core, core)))
        given = [w.strip("[]") for w in words]
        required = " ".join(words)
        while "[" in required:
            required = re.sub(r"\[[^\[\]]*\]", "", required)
        for argv in (given, required.split()):
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"README's `{synopsis}` is not a command line: {' '.join(argv)}")


def test_where_a_relative_data_path_is_read_is_said_in_readme_and_train_help(
        tmp_path, monkeypatch, capsys):
    """Both said a relative data path is read from the spec's folder; one given with --set
    is read from the current folder (restopo.spec.datapath.data_base), which neither said."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "here").mkdir()
    spec = tmp_path / "specs" / "s.restopo"
    spec.write_text(MODEL + 'residual standard\ntrain { data: "c.txt" }\n')
    (tmp_path / "specs" / "c.txt").write_text("text " * 100)
    monkeypatch.chdir(tmp_path / "here")
    assert main(["check", str(spec)]) == 0  # from the spec's folder
    assert main(["check", str(spec), "--set", "train.data=c.txt"]) == 1  # from here: none
    assert f"data path '{tmp_path / 'here' / 'c.txt'}' does not exist" in capsys.readouterr().err
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert ("relative to the spec's folder (one given with `--set train.data=PATH`, to the "
            "current folder)") in readme
    assert main(["train", "--help"]) == 0
    assert ("a relative path read from the spec's folder, or from the current folder when "
            "--set gives it") in " ".join(capsys.readouterr().out.split())


def test_the_quickstart_says_what_running_it_again_needs():
    """Run twice, the quickstart's command 3 stopped at export ('tiny.safetensors already
    exists ... --overwrite') and the README had not said so. Each of its commands that
    refuses an existing output says --overwrite on its line (a trailing comment) or in a
    sentence of the text that follows the block naming it (`restopo train` again ...)."""
    text = (ROOT / "README.md").read_text()
    block = blocks("sh")[0]
    after = text[text.index(block) + len(block):].split("\n## ")[0]
    sentences = re.split(r"(?<=[.;])\s+", " ".join(after.split()))
    parser, writers = build_parser(), 0
    for line in block.replace("\\\n", " ").splitlines():
        command = line.split("&&")[-1]
        argv = shlex.split(command, comments=True)
        if argv[:1] != ["restopo"] or not hasattr(parser.parse_args(argv[1:]), "overwrite"):
            continue
        writers += 1
        said = "--overwrite" in command.partition("#")[2] or any(
            f"`restopo {argv[1]}`" in s and "--overwrite" in s for s in sentences)
        assert said, f"the quickstart does not say what `{' '.join(argv)}` run again needs"
    assert writers >= 2  # train and export
