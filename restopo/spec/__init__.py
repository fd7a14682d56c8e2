"""The restopo language front-end: text -> checked Spec (-> Topology -> IR).

    from restopo.spec import as_spec, load_spec, parse_spec, SpecError
    spec = load_spec("examples/tiny.restopo", overrides=("model.width=64",))
    spec = as_spec(spec_or_path_or_text)        # what restopo.compile and rewire accept
    spec.model.kinds, spec.topology, spec.ir()

The language (grammar: grammars/restopo.lark; meaning: check.py)
------------------------------------------------------------------
A spec is a few sections, in any order, each at most once. Entries are `key: value`,
separated by newlines or ';' (optional where the next `key:` makes the boundary plain).
Comments run from '#' to the end of the line. Numbers: 256, 3e-3, 1_024, with a unit where
natural: 4x (a ratio), 32k (thousand), 2M (million). Paths are quoted.

    model tiny {                                 # the label is optional
      vocab: 256; width: 64; depth: 4; heads: 4; context: 64      # required
      mlp: swiglu(4x)                            # swiglu | gelu, (ratio) default 4x
      layer: attn mlp                            # one transformer layer's sublayers
      tie_embeddings: true
    }

    residual standard                            # h_l = v_0 + sum of earlier outputs
    residual full_attnres                        # options: query, gate, key_norm, heads,
    residual full_attnres(window: 8)             #   window (embedding + last w outputs)
    residual block_attnres(blocks: 8)            # or block_size: S (sublayers, even)
    residual block_attnres(blocks: 8, query: static, gate: softmax, key_norm: rms, heads: 1)
    residual rezero | layerscale | highway | denseformer
    residual denseformer(gate: softmax)          # static per-source scalars, softmax-
                                                 #   normalised, init 0 (the AttnRes ablation)

    residual custom {                            # any label; named topologies spelled out
      blocks: 4                                  # or block_size: 8; default one per sublayer
                                                 #   (one block for a single running stream)
      before sublayer: attend(embedding, blocks, partial; query: static, key_norm: rms)
      before head: attend(embedding, blocks)     # default: the sublayer rule minus partial
    }

    parallel { pipeline(stages: 2, virtual: 2, schedule: interleaved_1f1b, microbatches: 8) }
    train { data: builtin:stdlib; steps: 300; batch: 16; lr: 3e-3; schedule: cosine; warmup: 30 }

Rules: a method (attend | sum | scalars | rezero | layerscale | highway) over sources
(embedding | sublayers | window(w) | blocks | partial); options come after ';' (or ',').
attend takes query, gate (softmax | sigmoid), key_norm and heads. scalars takes gate only:
one learned static scalar a_i per (aggregation, source), and h = sum_i alpha_i v_i with
    gate: none      alpha = a, a init 1 (the default; DenseFormer, a standard residual at step 0)
    gate: softmax   alpha = softmax(a), a init 0 (the plain mean at step 0, like Full AttnRes:
                    "Full with static per-source scalars")
    gate: sigmoid   alpha = sigmoid(a), a init 0
so `denseformer(gate: softmax)` is `scalars(embedding, sublayers; gate: softmax)` before every
sublayer and the head. The other methods take no options. The stream methods (rezero,
layerscale, highway) always read the embedding and every earlier sublayer. The sublayer rule
must read the embedding (the first sublayer has nothing else); the head rule cannot read
partial.

Overrides: `section.key=value` sets or adds a key (in a one-liner's options too);
`residual=VALUE` / `parallel=VALUE` replace a one-line section. They are checked like the
file; their errors point into `--set ...` (path `<--set N>`).

Errors: SpecError(path, line, column, message, hint); several at once raise SpecErrors
(`.errors`), itself a SpecError. str() gives `FILE:LINE:COL: error: MESSAGE`, the line, a
caret, and `hint: ...`. A path that is not a regular file of at most MAX_SPEC_BYTES is an
OSError (SpecFileError says why); see files.py.
"""
from __future__ import annotations

import os

from .errors import SpecError, SpecErrors
from .files import MAX_SPEC_BYTES, SpecFileError, read_spec_file
from .objects import ModelSpec, ParallelSpec, ResidualSpec, Spec, TrainSpec


def parse_spec(text: str, path: str = "<string>", overrides=()) -> Spec:
    """Parse and check spec text; raises SpecError (SpecErrors for several mistakes)."""
    from .check import check
    from .files import as_read
    from .parse import parse_text
    text = as_read(text)
    return check(parse_text(text, path), text, override_texts(overrides))


def override_texts(overrides) -> tuple[str, ...]:
    """`overrides` as a tuple of KEY=VALUE texts: one text alone is one override (a tuple
    of it would be its characters, each then reported as a bad --set)."""
    return (overrides,) if isinstance(overrides, str) else tuple(overrides)


def load_spec(path, overrides=()) -> Spec:
    """Read and check a .restopo file. A path that is not a readable regular file of at
    most MAX_SPEC_BYTES raises OSError (SpecFileError says why: a folder, a FIFO, a device,
    too large), text that is not UTF-8 UnicodeDecodeError; mistakes in the text SpecError."""
    path = os.fspath(path)
    return parse_spec(read_spec_file(path), path, overrides)


def as_spec(spec_or_path, overrides=()) -> Spec:
    """A Spec from a Spec, a path to a .restopo file, or spec text."""
    overrides = override_texts(overrides)
    if isinstance(spec_or_path, Spec):
        if overrides:
            raise ValueError("overrides apply to a path or spec text, not to a parsed Spec; "
                             "pass the path (or text) instead")
        return spec_or_path
    if isinstance(spec_or_path, os.PathLike) or (
            isinstance(spec_or_path, str) and "\n" not in spec_or_path
            and os.path.exists(spec_or_path)):
        return load_spec(os.fspath(spec_or_path), overrides=overrides)
    if isinstance(spec_or_path, str):
        if "\n" not in spec_or_path and spec_or_path.endswith(".restopo"):
            raise FileNotFoundError(f"no such spec file: {spec_or_path}")
        return parse_spec(spec_or_path, path="<string>", overrides=overrides)
    raise TypeError(f"expected a Spec, a path or spec text; got {type(spec_or_path).__name__}")


__all__ = ["as_spec", "load_spec", "parse_spec", "SpecError", "SpecErrors", "Spec", "ModelSpec",
           "ResidualSpec", "TrainSpec", "ParallelSpec", "SpecFileError", "read_spec_file",
           "MAX_SPEC_BYTES"]
