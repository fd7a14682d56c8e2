"""Pipeline parallelism with the cross-stage block cache: the `pipeline` backend.

plan.py      pure functions over the IR: chunks balanced by cost, the values crossing each
             cut, naive and cached, bytes per token, the paper's bound (no torch)
report.py    the plan as JSON and as a table, for `restopo inspect --pipeline` (no torch)
stage.py     one chunk as an nn.Module (the model's own modules, run over the IR)
cache.py     the rank-local cache of block representations and its gradient path
runtime.py   PipelineStage + the library's schedules, bytes counted at the send calls
train.py     what restopo/train/loop.py calls to train through the pipeline
selfcheck.py a torchrun entry point holding a pipelined tiny model against one process

The names below are the backend's interface (`restopo.registry.get_backend("pipeline")`),
each imported on first use, so that planning and reporting never import torch.
"""
_INTERFACE = {"PlanError": "plan", "make_plan": "plan", "parse_pv": "plan",
              "to_json": "report", "describe": "report", "inspect_section": "report",
              "PipelineConfig": "train", "PipelinedStep": "train"}


def __getattr__(name):
    if name in _INTERFACE:
        import importlib
        return getattr(importlib.import_module(f".{_INTERFACE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
