"""Generated source never runs what a user wrote: restopo.codegen's literals round-trip any
text, and `restopo compile -o model.py` of specs with hostile file names and texts gives a
module that imports, runs nothing else, and holds the spec text exactly (issue 16, #1)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile import time_limit
import restopo
from restopo.cli import main
from restopo.codegen import literal, text_literal

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "examples" / "tiny.restopo").read_text()
ATTACK = 'import os; open("PWNED", "w").write("x")'


@pytest.fixture(autouse=True)
def _each_under_a_time_limit():  # as every test of issue 16: a hang is a failure, not a stall
    with time_limit(600):
        yield


@settings(max_examples=300, deadline=None)
@given(st.text(), st.sampled_from(["'''", '"""']), st.booleans())
def test_text_literal_is_one_string_equal_to_the_text(text, quote, raw):
    source = text_literal(text, quote, raw)
    tree = ast.parse(source, mode="eval")  # one expression, nothing after it
    assert ast.literal_eval(tree) == text
    # and the same inside a module, as compile writes it: a file, newline translation on
    namespace = {}
    exec(compile(f"X = {source}\n".encode(), "<generated>", "exec"), namespace)
    assert namespace["X"] == text


@pytest.mark.parametrize("text", ["plain", "ends in a quote'", "ends in a backslash\\",
                                  "nul \x00 byte", "trailing ''", "'''", '"""', "cr\r\nlf",
                                  "\udcff surrogate", "tab\tand é and \U0001f600",
                                  "'''; import os; os.system('x'); '''"])
def test_hostile_texts(text):
    for quote in ("'''", '"""'):
        for raw in (True, False):
            source = text_literal(text, quote, raw)
            assert ast.literal_eval(ast.parse(source, mode="eval")) == text
            source.encode("utf-8")  # writable as a module's UTF-8 source


def test_readable_form_is_kept_when_safe():
    assert text_literal("a\nb\n") == "r'''a\nb\n'''"
    assert text_literal('doc "quoted"\n', '"""', raw=False) == '"""doc "quoted"\n"""'


def test_literal_round_trips_data_and_refuses_the_rest():
    for value in ("x'\"\n", ("a", "b\\"), [1, 2.5, None, True], {"k": ("v",)}, -3):
        assert ast.literal_eval(literal(value)) == value
    for value in (object(), float("nan"), float("inf"), ("ok", print)):
        with pytest.raises(TypeError):
            literal(value)


HOSTILE_NAMES = [
    f'we"""\n{ATTACK}\n""".restopo',
    f"we'''\n{ATTACK}\n'''.restopo",
    "back\\slash.restopo", "quote'.restopo", "tab\tname.restopo", "é\U0001f600.restopo",
]
HOSTILE_TEXTS = [
    SPEC.rstrip("\n") + "\n# ends in a quote'",             # no newline after the quote
    SPEC + "# a NUL \x00 byte in a comment\n",
    SPEC + "# trailing ''",
    SPEC + "# ''' and \"\"\" and \\\n",
    SPEC + f"# '''\n# {ATTACK}\n# '''\n",
    SPEC + "# ends in a backslash \\",
    SPEC.replace("\n", "\r\n"),
]


def _import_all(modules: list[Path], cwd: Path) -> list:
    """Import each generated module in one fresh interpreter (cwd: where PWNED would land);
    [(SPEC, __doc__)] in order."""
    code = ("import importlib.util, sys\nout = []\n"
            f"for i, path in enumerate({[str(m) for m in modules]!r}):\n"
            "    s = importlib.util.spec_from_file_location(f'm{i}', path)\n"
            "    m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "    out.append((m.SPEC, m.__doc__))\n"
            "sys.stdout.write(repr(out))\n")
    done = subprocess.run([sys.executable, "-W", "error::SyntaxWarning", "-W",
                           "error::DeprecationWarning", "-c", code], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout)


@pytest.mark.slow
def test_compile_of_hostile_names_and_texts_imports_and_runs_nothing(tmp_path, capsys):
    cases = [(n, SPEC) for n in HOSTILE_NAMES] + [("tiny.restopo", t) for t in HOSTILE_TEXTS]
    modules, specs = [], []
    for i, (name, text) in enumerate(cases):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        spec = folder / name
        spec.write_bytes(text.encode())
        out = folder / "m.py"
        assert main(["compile", str(spec), "-o", str(out)]) == 0, capsys.readouterr().err
        modules.append(out)
        specs.append(spec)
    run = tmp_path / "cwd"
    run.mkdir()
    got = _import_all(modules, run)
    assert not list(tmp_path.rglob("PWNED"))
    for (name, text), spec, (got_spec, doc) in zip(cases, specs, got):
        assert got_spec == text.replace("\r\n", "\n")  # as read, a trailing '' included
        assert os.path.basename(str(spec)) in doc


def test_hostile_output_name(tmp_path, capsys):
    out = tmp_path / f'o"""\n{ATTACK}\n""".py'
    spec = tmp_path / "tiny.restopo"
    spec.write_text(SPEC)
    # the command refuses a name no import could name; nothing is written
    assert main(["compile", str(spec), "-o", str(out)]) == 1
    assert "cannot be imported" in capsys.readouterr().err and not out.exists()
    # and the writer itself, given such a name, keeps it inside the docstring
    from restopo.commands.standalone import module_source
    model = restopo.compile(restopo.load_spec(str(spec)))
    source = module_source(model, out.stem, spec.name)
    tree = ast.parse(source)
    docstring = ast.get_docstring(tree, clean=False)
    assert docstring.startswith(out.stem)  # the name stays inside the docstring
    # nothing but the imports (of torch and the standard library), constants, classes and
    # functions at the top of the module
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "Import", "ImportFrom", "Assign", "ClassDef", "FunctionDef"}
    imported = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "collections", "contextlib", "itertools", "types",
                        "torch"}, imported
    calls = [n for n in tree.body if isinstance(n, ast.Expr) and not isinstance(n.value,
                                                                               ast.Constant)]
    assert not calls
