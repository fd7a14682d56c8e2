"""restopo: a language and compiler for the residual topologies of transformers."""
__version__ = "0.1.0"

# Everything is imported on first use: the model API, so `import restopo` (and the CLI, the
# grammar and the IR) stay usable without paying for torch; the rest, so that `python -m
# restopo` is in restopo's own code, which takes a Ctrl-C as a stop, within a millisecond.
_LAZY = {"SpecError": "spec.errors", "SpecErrors": "spec.errors",
         "compile": "api", "aggregations": "api", "set_backend": "api", "direct": "api",
         "rewire": "fx.rewire",
         "generate": "decode", "load": "saved", "export": "saved",
         "load_spec": "spec", "parse_spec": "spec", "RewireError": "fx.rewire"}


def __getattr__(name):
    if name == "ops":  # `restopo.ops.depth_attention(...)` without importing restopo.ops
        import importlib
        return importlib.import_module(".ops", __name__)
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'restopo' has no attribute {name!r}")
