"""The backend registry: backends found by name through their entry points."""
import importlib
import types

import pytest
import torch

from restopo import ops, registry
from restopo.ops import get_backend, register_backend
from restopo.registry import BackendNotFound


@pytest.mark.parametrize("name", ["eager", "triton", "cpu", "pipeline"])
def test_each_backend_is_its_package(name):
    assert get_backend(name) is importlib.import_module(f"restopo.backends.{name}")


def test_an_unknown_backend_names_the_installed_ones():
    with pytest.raises(BackendNotFound, match=r"installed: cpu, eager, pipeline, triton"):
        get_backend("cuda")


def test_without_entry_points_it_says_to_reinstall(monkeypatch):
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    with pytest.raises(BackendNotFound, match=r"reinstall restopo with `pip install -e \.`"):
        get_backend("not-loaded-yet")


def test_ops_dispatch_to_the_registered_backend():
    eager = get_backend("eager")
    calls = []
    stand_in = types.SimpleNamespace(depth_attention=lambda *a, **k: calls.append(k) or "h")
    register_backend("eager", stand_in)
    try:
        assert ops.depth_attention(torch.zeros(2, 3, 4), torch.zeros(4), backend="eager") == "h"
    finally:
        register_backend("eager", eager)
    assert calls == [{"key_norm": True, "gate": "softmax", "heads": 1}]
