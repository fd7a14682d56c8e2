"""Pipeline parallelism with the cross-stage block cache.

plan.py      pure functions over the IR: chunks balanced by cost, the values crossing each
             cut, naive and cached, bytes per token, the paper's bound (no torch)
report.py    the plan as JSON and as a table, for `restopo inspect --pipeline` (no torch)
stage.py     one chunk as an nn.Module (the model's own modules, run over the IR)
cache.py     the rank-local cache of block representations and its gradient path
runtime.py   PipelineStage + the library's schedules, bytes counted at the send calls
train.py     what restopo/train/loop.py calls to train through the pipeline
selfcheck.py a torchrun entry point holding a pipelined tiny model against one process
"""
