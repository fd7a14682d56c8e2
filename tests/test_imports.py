"""restopo's imports: no cycles, no upward imports (tools/check_imports.py), and every
package imports on its own in a fresh interpreter, the light ones without torch."""
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from file_modules import load_file

ROOT = Path(__file__).resolve().parents[1]
check_imports = load_file(ROOT / "tools" / "check_imports.py", "check_imports")

PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
TORCH_FREE = {"restopo", "restopo.spec", "restopo.ir", "restopo.grammars", "restopo.commands",
              "restopo.backends", "restopo.backends.pipeline"}


def test_the_tree_has_no_cycles_and_no_upward_imports():
    problems = check_imports.check(ROOT)
    assert not problems, "\n".join(problems)


# -- the check itself, on a small tree laid out like restopo's ------------------------------

TREE = {
    "pyproject.toml": '[tool.setuptools]\n'
                      'package-dir = { "restopo" = "restopo", "restopo.backends" = "backends" }\n',
    "restopo/__init__.py": "",
    "restopo/topology.py": "X = 1\n",
    "restopo/ir/__init__.py": "from .build import build_ir\n",
    "restopo/ir/build.py": "from ..topology import X\n\n\ndef build_ir():\n    return X\n",
    "backends/__init__.py": "",
    "backends/eager/__init__.py": "from restopo.topology import X\n",
}

LAZY = "\n\ndef later():\n    {}\n"


def _tree(root: Path, extra: dict[str, str] | None = None) -> Path:
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + (extra or {}).get(rel, ""))
    return root


def test_a_tree_in_order_passes(tmp_path):
    assert check_imports.check(_tree(tmp_path)) == []


@pytest.mark.parametrize("file,line,expected", [
    # a relative import inside a function closes a cycle and points up a layer
    ("restopo/topology.py", "from .ir.build import build_ir",
     ["import cycle among restopo.ir.build, restopo.topology: "
      "restopo.ir.build (restopo/ir/build.py:1) -> restopo.topology (restopo/topology.py:5)"
      " -> restopo.ir.build",
      "restopo/topology.py:5: restopo.topology imports restopo.ir.build, but topology sits "
      "below ir in the layers"]),
    # the backends are reached through the registry, never imported
    ("restopo/ir/build.py", "import restopo.backends.eager",
     ["restopo/ir/build.py:9: restopo.ir.build imports restopo.backends.eager; backends are "
      "reached through restopo.registry, not imported"]),
])
def test_a_bad_import_is_reported(tmp_path, file, line, expected):
    assert check_imports.check(_tree(tmp_path, {file: LAZY.format(line)})) == expected


def test_an_undeclared_layer_is_reported(tmp_path):
    _tree(tmp_path)
    (tmp_path / "restopo" / "extras.py").write_text("")
    assert check_imports.check(tmp_path) == [
        "layer 'extras' (restopo.extras) is not in LAYERS: add it where it belongs"]


def test_a_cycle_added_to_a_copy_of_the_tree_is_reported(tmp_path):
    for name in ("restopo", "backends", "grammars"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    before = set(check_imports.check(tmp_path))
    with open(tmp_path / "restopo" / "topology.py", "a") as f:
        f.write(LAZY.format("from . import api"))
    new = set(check_imports.check(tmp_path)) - before
    assert any(p.startswith("import cycle among ") and "restopo.topology" in p
               and "restopo.api" in p for p in new), new
    assert any("restopo.topology imports restopo.api, but topology sits below api" in p
               for p in new), new


# -- every package imports in a fresh interpreter -------------------------------------------

def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_cleanly(package):
    torch = _fresh(f"import sys, {package}; print('torch' in sys.modules)")
    if package in TORCH_FREE:
        assert torch == "False", f"import {package} imported torch"


@pytest.mark.parametrize("argv", [
    ["check", "examples/tiny.restopo"],
    ["inspect", "examples/block_attnres.restopo", "--pipeline", "4x2"],  # via the registry
])
def test_light_commands_do_not_import_torch(argv):
    torch = _fresh(f"import sys; from restopo.cli import main; assert main({argv!r}) == 0; "
                   f"print('torch' in sys.modules)")
    assert torch == "False"


# -- the scripts beside the package: bench/ and tools/ ---------------------------------------

SCRIPT_DIRS = ("bench", "tools")


def test_no_script_is_named_like_an_importable_module():
    """`python bench/x.py` puts bench/ first on sys.path, so a script named like an
    installed package hides it from everything that process imports: bench/kernels.py
    hid the `kernels` package transformers 5.25 imports, and CI failed while collecting
    tests/test_rewire_llama.py (a test had put bench/ on the path). Neither folder is on
    this process's path, so a name found here is somebody else's."""
    found = {}
    for folder in SCRIPT_DIRS:
        for path in sorted((ROOT / folder).glob("*.py")):
            spec = importlib.util.find_spec(path.stem)
            if spec is not None:
                found[f"{folder}/{path.name}"] = spec.origin
    assert found == {}, f"rename these scripts (the name is taken): {found}"


def test_nothing_puts_the_script_folders_on_the_import_path():
    """Tests and benches import a script by its path (tests/file_modules.py), never by
    putting its folder on sys.path, where its name would shadow a package for the whole
    test session."""
    files = [p for folder in ("tests", *SCRIPT_DIRS) for p in sorted((ROOT / folder).rglob("*.py"))]
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in files
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"sys\.path\.(insert|append)|sys\.path\s*\+?=", line)]
    assert offenders == []
