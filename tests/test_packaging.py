"""The installed package is laid out as pyproject.toml says."""
import importlib
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _declared():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return cfg["packages"], cfg["package-dir"]


def test_every_package_folder_is_declared():
    packages, dirs = _declared()
    found = set()
    for prefix, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    assert found == set(packages), "add new sub-packages to [tool.setuptools] packages"


def test_backends_import_as_restopo_backends():
    eager = importlib.import_module("restopo.backends.eager.depth")
    assert pathlib.Path(eager.__file__).resolve().is_relative_to(ROOT / "backends")


def test_grammar_ships_with_the_package():
    from importlib.resources import files
    assert (files("restopo.grammars") / "restopo.lark").is_file()
