"""The text of a standalone model.py: a compiled model as one Python file importing only torch.

The file holds restopo's own code, taken from its modules with `inspect` (one source of
truth, nothing rewritten by hand): the eager depth-attention kernels (the eager backend),
the sublayers, the aggregation modules the model uses, then a `RestopoModel` whose
`__init__` builds the same submodule tree (so `restopo compile -o model.pt` weights and
`restopo export` safetensors load with strict=True) and whose forward is the lowered fx
graph's generated code. Every user-derived value that reaches the generated source goes
through restopo.codegen (a literal proved to parse back to the value).
"""
from __future__ import annotations

import ast
import inspect
import re

from ..codegen import literal, text_literal
from ..nn import aggregate, norm, streams, sublayers
from ..nn.norm import NORM_EPS
from ..registry import get_backend
from ..saved import STANDALONE

DOC = """{name}: written by `restopo {command}` from {source}; """ + STANDALONE + """.

Topology {topology}; {sublayers} sublayers. Copy this file anywhere:

{usage}

A training run's weights: `restopo export RUN -o weights.safetensors`, then
model.load_state_dict(safetensors.torch.load_file("weights.safetensors")). (A checkpoint's
own model.safetensors keeps a tied head's weight once, under the embedding's name: a
strict load misses head.lm_head.weight.)

The depth-attention kernels, sublayers and aggregation modules below are restopo's own
eager backend: without autograd (under torch.no_grad) the outputs equal
restopo.load(..., backend="eager") bit for bit. With autograd on they agree up to float
rounding, not bit for bit: restopo's eager backend then computes each source's
depth-attention logits for all its readers in one matmul, which this file leaves out.
Those of restopo's default backend (fused kernels) agree up to float rounding. The forward
at the end is the lowered graph's generated code.
"""

HEADER = '''{doc}
from __future__ import annotations

{imports}import math
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

SPEC = {spec}
OVERRIDES = {overrides}
NORM_EPS = {eps}
EPS = NORM_EPS
'''

STREAM_IMPORTS = "import contextlib\nimport itertools\n"  # restopo.nn.streams uses them

OPS = '''

class ops:
    """restopo.ops with its eager backend only (`backend=` is accepted and ignored)."""

    @staticmethod
    def depth_attention(*args, backend=None, **kwargs):
        return depth_attention(*args, **kwargs)

    @staticmethod
    def phase1(*args, backend=None, **kwargs):
        return phase1(*args, **kwargs)

    @staticmethod
    def phase2(*args, backend=None, **kwargs):
        return phase2(*args, **kwargs)

    @staticmethod
    def depth_weights(*args, **kwargs):
        return depth_weights(*args, **kwargs)

    @staticmethod
    def cpu_kernels(backend, device, dtype):  # no fused kernels here: compile every region
        return False

    # calls bound once per parameter version (restopo.ops.bind_*): here the plain calls
    @staticmethod
    def bind_phase1(*args, backend=None, norm_weight=None, norm_eps=None, **kwargs):
        # no first PreNorm to make here: only restopo's lowering fuses one into phase 1
        # (TwoPhase.fuse_first_norm), and this file's forward was written without it
        assert norm_eps is None, "a standalone TwoPhase has no first_norm"
        return lambda completed: phase1(completed, *args, **kwargs)

    @staticmethod
    def bind_depth_attention(*args, backend=None, **kwargs):
        return lambda sources: depth_attention(sources, *args, **kwargs)

    @staticmethod
    def bind_phase2(query, key_norm_weight, eps, *, norm_weight, norm_eps, key_norm, keep_h,
                    backend=None):
        if norm_eps is None:
            return lambda o1, m1, s1, partial: phase2(o1, m1, s1, partial, query,
                                                      key_norm_weight, eps, key_norm=key_norm)
        return lambda o1, m1, s1, partial: phase2_norm(
            o1, m1, s1, partial, query, key_norm_weight, eps, norm_weight=norm_weight,
            norm_eps=norm_eps, key_norm=key_norm, keep_h=keep_h)

    @staticmethod
    def rms_norm(*args, **kwargs):
        return rmsnorm.rms_norm(*args, **kwargs)
'''

FOOTER = '''

def build():
    """The model (PyTorch's default initialisation; load trained weights strictly)."""
    return RestopoModel()
'''

SUBLAYER_CODE = (norm.RMSNorm, sublayers.check_batched, sublayers.token_ids_in,
                 sublayers.check_token_ids, sublayers.TokenEmbedding, sublayers.Rotary,
                 sublayers.apply_rotary, sublayers.KVCache, sublayers.Attention,
                 sublayers.swiglu_hidden, sublayers.mlp_hidden, sublayers.MLP, sublayers.Head)

# check_token_ids calls token_ids_in through restopo's custom op; the written file calls a
# function of its own instead (it imports only torch, and the op registered again beside
# restopo fails), one that torch.compile leaves out: traced, its read of the ids would break
# the graph, which restopo's opaque op does not
TOKEN_IDS_OP = "torch.ops.restopo.token_ids_in("
TOKEN_IDS_CALL = "token_ids_in_eager("
TOKEN_IDS_EAGER = '''

def token_ids_in_eager(idx: torch.Tensor, vocab: int) -> None:
    """token_ids_in outside torch.compile: a compiled forward leaves the check out."""
    if not torch.compiler.is_compiling():
        token_ids_in(idx, vocab)
'''


def _source(obj) -> str:
    return inspect.getsource(obj).rstrip() + "\n"


def _sublayer_code() -> str:
    code = "\n\n".join(_source(c) for c in SUBLAYER_CODE)
    assert code.count(TOKEN_IDS_OP) == 1, f"check_token_ids should call {TOKEN_IDS_OP}...)"
    return code.replace(TOKEN_IDS_OP, TOKEN_IDS_CALL) + TOKEN_IDS_EAGER


def _kernels() -> str:
    """The eager backend (depth.py, the two forms it picks between, unstacked.py and
    stacked.py, the weighted sum they share, weighted.py, and the PreNorm's rmsnorm.py) as
    top-level code: each module's functions get its prefix (`_stacked_phase1`) and are
    gathered in a namespace of the module's name, which depth.py's code calls."""
    eager = get_backend("eager")
    depth = inspect.getmodule(eager.depth_attention)
    code, names = [], {}
    for module in (depth.weighted, depth.rmsnorm, depth.unstacked, depth.stacked):
        # each imports only the earlier ones
        short = module.__name__.rpartition(".")[2]
        own = {n: f"_{short}_{n}" for n, f in inspect.getmembers(module, inspect.isfunction)
               if f.__module__ == module.__name__}
        renamed = {**_imported(module, names), **own}
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, renamed)) + r")\b")
        body = pattern.sub(lambda m: renamed[m.group(1)], _body(inspect.getsource(module)))
        fields = ", ".join(f"{n}={p}" for n, p in own.items())
        code.append(f"{body}\n\n{short} = SimpleNamespace({fields})\n")
        names[short] = own
    return ("\n\n# ---- depth-attention kernels (restopo's eager backend)\n"
            + "\n\n".join(code) + "\n\n" + _body(inspect.getsource(depth)))


def _imported(module, names: dict) -> dict:
    """name -> its prefixed name, for `from .other import name` of an earlier module."""
    out = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in names:
            out.update({a.name: names[node.module][a.name] for a in node.names})
    return out


def _body(module_source: str) -> str:
    """A module's code without its docstring and imports (the header has the imports)."""
    lines = module_source.splitlines()
    i = 0
    if lines and lines[0].startswith('"""'):
        i = 1 if lines[0].count('"""') == 2 else next(
            k for k in range(1, len(lines)) if '"""' in lines[k]) + 1
    out = [ln for ln in lines[i:] if not ln.startswith(("from ", "import "))]
    return "\n".join(out).strip("\n") + "\n"


def _constructor(m, spec, index: int = 0) -> str:
    """The call that builds module `m` again (its class's constructor, repr'd values);
    `index`: the aggregation point's l (a Hyper-Connection's init reads it)."""
    name = type(m).__name__
    if isinstance(m, sublayers.Attention):
        return f"Attention({m.qkv.in_features!r}, {m.heads!r})"
    if isinstance(m, sublayers.MLP):
        return f"MLP({m.up.in_features!r}, {m.kind!r}, {float(spec.model.mlp_ratio)!r})"
    if isinstance(m, aggregate.Attend):
        key_norm = "rms" if m.key_norm is not None else "none"
        return f"Attend({m.d!r}, {m.query!r}, {m.gate!r}, {key_norm!r}, {m.heads!r})"
    if isinstance(m, aggregate.Scalars):
        return f"Scalars({m.weights.numel()!r}, {m.gate!r})"
    if isinstance(m, aggregate.LayerScale):
        return f"LayerScale({m.gamma.numel()!r})"
    if isinstance(m, aggregate.Highway):
        return f"Highway({m.d!r})"
    if isinstance(m, streams.HyperConnection):
        return f"HyperConnection({m.n!r}, {m.d!r}, {index!r}, {m.dynamic!r})"
    if isinstance(m, streams.ManifoldHyperConnection):
        return f"ManifoldHyperConnection({m.n!r}, {m.d!r}, {m.sinkhorn_iters!r})"
    if isinstance(m, streams.LiteHyperConnection):
        return f"LiteHyperConnection({m.n!r}, {m.d!r})"
    if isinstance(m, streams.StreamExpand):
        return f"StreamExpand({m.n!r})"
    if isinstance(m, (aggregate.Sum, aggregate.ReZero, aggregate.StreamStart,
                      streams.StreamSum, streams.StreamWrite)):
        return f"{name}()"
    raise ValueError(f"the standalone writer does not know {name}; "
                     f"write -o model.pt and use restopo instead")


def _aggregation_code(model) -> str:
    used = {type(m) for m in model.aggregations}
    if len(model.phases):
        used |= {aggregate.Attend, aggregate.TwoPhase}
    order = (aggregate.Attend, aggregate.TwoPhase, aggregate.Sum, aggregate.Scalars,
             aggregate.ReZero, aggregate.LayerScale, aggregate.Highway, aggregate.StreamStart)
    code = "\n\n".join(_source(c) for c in order if c in used)
    if aggregate.TwoPhase in used:  # its members' slices of phase 1
        code += "\n\n" + _source(aggregate._per_member)
    if aggregate.Attend in used:  # its no-grad path keeps the gained query (derived)
        code = "\n\n".join([*(_source(f) for f in (aggregate.own, aggregate.derived,
                                                     aggregate.trusted, aggregate.Kept,
                                                     aggregate.unrecorded)),
                              code])
        code = "FIXED_FOR = [None]  # no decoding sequence here (restopo.decode)\n\n\n" + code
    if _multi_stream(model):  # restopo.nn.streams whole: its classes share helpers
        code += ("\n\n# ---- multi-stream modules (restopo.nn.streams)\n\n"
                 + _body(inspect.getsource(streams)))
    return code


def _multi_stream(model) -> bool:
    return hasattr(model, "expand_streams")


def _init(model, spec) -> str:
    ind = " " * 8
    lines = ["", "", "class RestopoModel(nn.Module):",
             "    def __init__(self):", "        super().__init__()"]
    emb = model.embed
    lines.append(f"{ind}self.embed = TokenEmbedding({emb.num_embeddings!r}, "
                 f"{emb.embedding_dim!r})")
    ctx = model.context
    lines.append(f"{ind}self.context = Rotary({ctx.cos.shape[1]!r}, {ctx.context!r})")
    lines.append(f"{ind}self.sublayers = nn.ModuleList([")
    lines += [f"{ind}    {_constructor(m, spec)}," for m in model.sublayers]
    lines.append(f"{ind}])")
    lines.append(f"{ind}self.aggregations = nn.ModuleList([")
    lines += [f"{ind}    {_constructor(m, spec, l)},"
              for l, m in enumerate(model.aggregations, start=1)]
    lines.append(f"{ind}])")
    if _multi_stream(model):
        lines.append(f"{ind}self.expand_streams = {_constructor(model.expand_streams, spec)}")
        lines.append(f"{ind}self.write_streams = {_constructor(model.write_streams, spec)}")
    index = {id(m): i for i, m in enumerate(model.aggregations)}
    groups = [[index[id(m)] for m in p.members] for p in model.phases]
    if groups:
        lines.append(f"{ind}self.phases = nn.ModuleList(TwoPhase([self.aggregations[i] for i "
                     f"in members]) for members in {groups!r})")
    else:  # TwoPhase is not written into a module without two-phase groups
        lines.append(f"{ind}self.phases = nn.ModuleList()")
    head = model.head.lm_head
    lines.append(f"{ind}self.head = Head({head.in_features!r}, {head.out_features!r})")
    if head.weight is emb.weight:
        lines.append(f"{ind}self.head.lm_head.weight = self.embed.weight  # tied")
    return "\n".join(lines) + "\n"


# What the written module imports: a module of one of these names would be imported in
# their place by any script beside it, the generated module itself included.
IMPORTED = ("torch", "math", "collections", "types", "contextlib", "itertools", "__future__")


def module_path_error(path: str) -> str | None:
    """Why `path` cannot be a standalone module (None: it can, or it is no .py file):
    NAME.py must be importable (an identifier, not a keyword) and must not shadow a module
    it imports."""
    import keyword
    import os
    name, ext = os.path.splitext(os.path.basename(path))
    if ext != ".py":
        return None
    if not name.isidentifier() or keyword.iskeyword(name):
        fixed = re.sub(r"\W", "_", name)
        fixed = fixed if fixed.isidentifier() and not keyword.iskeyword(fixed) else \
            f"model_{fixed}"
        return (f"the module name {name!r} cannot be imported (not a Python identifier, or a "
                f"keyword); "
                f"name the file e.g. {fixed}.py")
    if name in IMPORTED:
        return (f"{name}.py would shadow the {name} module it imports, for any script beside "
                f"it; choose another name")
    return None


def _usage(name: str, command: str) -> str:
    """The docstring's example of using the module `name`, its comments in one column
    whatever the name's length."""
    lines = ((f"import torch, {name}", ""),
             (f"model = {name}.build()", "PyTorch's default initialisation"),
             (f'blob = torch.load("{name}.pt")', f"restopo {command} ... -o {name}.pt"),
             ('model.load_state_dict(blob["state_dict"])', "strict"),
             ("logits = model(idx)", "idx [B, T] token ids -> [B, T, vocab]"))
    width = max(len(code) for code, _ in lines) + 2
    return "\n".join(f"    {code:<{width}}# {note}" if note else f"    {code}"
                     for code, note in lines)


def module_source(model, name: str, source: str, command: str = "compile") -> str:
    """The text of a standalone module that builds `model` (a restopo.compile model)."""
    from ..fx.lower import lower, parts_of
    from ..decode import require_own_sublayers
    parts = parts_of(model)
    require_own_sublayers(parts)  # restopo's own sublayers, which this file copies
    spec = model.restopo_spec
    g = model.restopo_ir
    doc = DOC.format(name=name, source=source, topology=g.topology, sublayers=g.n_sublayers,
                     command=command, usage=_usage(name, command))
    head = HEADER.format(doc=text_literal(doc, '"""', raw=False),
                         imports=STREAM_IMPORTS if _multi_stream(model) else "",
                         spec=text_literal(model.spec_text),
                         overrides=literal(tuple(getattr(model, "restopo_overrides", ()))),
                         eps=literal(NORM_EPS))
    # the file runs the eager backend, so its forward is the eager lowering's (a fused
    # backend's lowering hands the sublayers' norms to phase 2)
    code = lower(g, parts, backend="eager", two_phase=len(model.phases) > 0,
                 aggregations=model.aggregations, share=False).code
    forward = "\n".join(("    " + line) if line.strip() else ""
                        for line in code.strip("\n").splitlines())
    parts = [head, _kernels(), OPS, "\n# ---- sublayers (restopo.nn.sublayers)\n\n",
             _sublayer_code(),
             "\n\n# ---- aggregation modules (restopo.nn.aggregate)\n\n",
             _aggregation_code(model), _init(model, spec), "\n" + forward.rstrip() + "\n",
             FOOTER]
    return "".join(parts)
