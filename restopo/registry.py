"""Backends by name: the one registry through which restopo reaches its backends.

A backend is an object holding the functions its users call: `eager` and `triton` give
depth_attention, phase1 and phase2 (restopo.ops dispatches to them), `pipeline` the planner,
its reports and the trainer. Each is an entry point of the group `restopo.backends`
(pyproject.toml), loaded on first use: no module of the core names a backend module, and
`import restopo` loads none. `register_backend` adds or replaces one by hand (a stand-in in
a test, a backend that is not installed as a package).

No torch here: `restopo inspect --pipeline` reaches the planner without it.
"""
from __future__ import annotations

from importlib.metadata import entry_points

GROUP = "restopo.backends"

_backends: dict[str, object] = {}


class BackendNotFound(ImportError):
    """No backend of that name is registered, nor installed as an entry point."""


def register_backend(name: str, backend: object) -> None:
    """Make `backend` the one `get_backend(name)` returns."""
    _backends[name] = backend


def get_backend(name: str):
    """The backend called `name`, its entry point loaded on first use."""
    if name not in _backends:
        installed = {ep.name: ep for ep in entry_points(group=GROUP)}
        if name not in installed:
            raise BackendNotFound(_not_found(name, sorted(installed)))
        _backends[name] = installed[name].load()
    return _backends[name]


def _not_found(name: str, installed: list[str]) -> str:
    if not installed:
        return (f"restopo backend {name!r} not found: restopo's backends are not registered "
                f"(no entry points in the group {GROUP!r}); reinstall restopo with "
                f"`pip install -e .`")
    return (f"no restopo backend named {name!r} (installed: {', '.join(installed)}; one newly "
            f"added to pyproject.toml needs `pip install -e .` again)")
