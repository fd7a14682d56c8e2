"""The restopo language front-end: text -> checked Spec (-> Topology -> IR).

    from restopo.spec import load_spec, parse_spec, SpecError
    spec = load_spec("examples/tiny.restopo", overrides=("model.width=64",))
    spec.model.kinds, spec.topology, spec.ir()
"""
from __future__ import annotations

import os

from .errors import SpecError, SpecErrors
from .objects import ModelSpec, ParallelSpec, ResidualSpec, RuleSpec, Spec, TrainSpec


def parse_spec(text: str, path: str = "<string>", overrides=()) -> Spec:
    """Parse and check spec text; raises SpecError (SpecErrors for several mistakes)."""
    from .check import check
    from .parse import parse_text
    if isinstance(overrides, str):
        overrides = (overrides,)
    return check(parse_text(text, path), text, tuple(overrides))


def load_spec(path, overrides=()) -> Spec:
    """Read and check a .restopo file. File errors (FileNotFoundError, UnicodeDecodeError,
    ...) propagate unchanged; mistakes in the text raise SpecError."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        e.restopo_path = path  # so the CLI can name the file
        raise
    return parse_spec(text, path, overrides)


__all__ = ["load_spec", "parse_spec", "SpecError", "SpecErrors", "Spec", "ModelSpec",
           "ResidualSpec", "RuleSpec", "TrainSpec", "ParallelSpec"]
