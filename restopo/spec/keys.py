"""The keys of each section, and the one section each key belongs to: read by the checking
pass, by the parser's and the sections' hints for a key written where it does not belong."""
from __future__ import annotations

from .resolve import NAMED_OPTIONS

MODEL_REQUIRED = ("vocab", "width", "depth", "heads", "context")
MODEL_KEYS = MODEL_REQUIRED + ("mlp", "mlp_ratio", "layer", "tie_embeddings")
TRAIN_KEYS = ("data", "steps", "batch", "lr", "schedule", "warmup", "min_lr", "weight_decay",
              "grad_clip", "accum", "eval_every", "eval_batches", "save_every", "seed",
              "log_every", "keep", "peak_tflops", "recompute", "compile")
PARALLEL_KEYS = ("stages", "virtual", "schedule", "microbatches", "cache", "data")
# the keys that shape a pipeline, which only a section with stages takes
PIPELINE_KEYS = tuple(k for k in PARALLEL_KEYS if k not in ("stages", "data"))
# The one section each key belongs to (keys of two sections, data, schedule or heads, are
# left out), for a key written in another section; the residual's are its topologies' options.
_SECTION_KEYS = (("model", MODEL_KEYS), ("train", TRAIN_KEYS), ("parallel", PARALLEL_KEYS),
                 ("residual", tuple({k for keys in NAMED_OPTIONS.values() for k in keys})))
KEY_HOMES = {k: sec for sec, keys in _SECTION_KEYS for k in keys
             if sum(k in ks for _, ks in _SECTION_KEYS) == 1}
