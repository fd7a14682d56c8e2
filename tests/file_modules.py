"""Python files imported as modules by path: the bench/ scripts (for the tests that run
their CI-size smoke modes), tools/ and generated code."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_file(path, name: str):
    """The module in file `path`, imported afresh under `name` (its state is its own)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(name: str):
    """bench/<name>.py."""
    return load_file(ROOT / "bench" / f"{name}.py", f"bench_{name}")
