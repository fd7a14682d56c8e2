"""Every code block of README.md runs or checks as shown: Python blocks run, spec blocks
parse and check, shell lines name real commands, options and files, and the `restopo check`
transcript is what the command prints."""
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
