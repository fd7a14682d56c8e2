"""Does a topology start as the standard residual? Measured, and predicted from the IR.

With zero pseudo-queries an AttnRes aggregation is the plain mean of its sources; a block
sum or a partial is the sum of its members; DenseFormer's scalars start at 1 and the
softmax/sigmoid scalar ablations weigh every source alike. Whenever every aggregation point
weighs every earlier output (and the embedding) alike, h_l is the standard residual's h_l
times a positive factor, which the next RMSNorm removes: the model computes exactly the
standard model at step 0 (up to rounding, with restopo's negligible norm epsilon; see
restopo.nn.norm). Every difference in training then comes from what the queries learn.
"""
from __future__ import annotations

import torch

from .. import topology as T
from ..api import build_model
from ..ir import IR, BlockSum, Partial, Sublayer
from ..nn.init import Init

# Tolerances on max |logits - standard logits| / max |standard logits| at step 0.
STANDARD_AT_INIT_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
_UNIFORM_AT_INIT = ("attend", "sum", "scalars")  # methods that weigh their sources alike
# Hyper-Connections start as PreNorm exactly (one-hot read, identity mixing, unit writes);
# mHC and mHC-lite only up to O(alpha phi): their random phi breaks the streams' symmetry.
_STREAMS_START_AS_STANDARD = ("hyper_connections",)


def starts_as_standard(g: IR) -> bool:
    """True when the IR's step-0 function is the standard residual: every aggregation point
    uses a method that weighs its sources alike at initialisation and its sources cover the
    embedding and every earlier sublayer output exactly once (block sums and partials count
    their members). Stream updates (ReZero, LayerScale, Highway) start elsewhere; a sliding
    window leaves outputs out. Of the multi-stream methods, Hyper-Connections do."""
    if g.aggregation(1).multi_stream:
        return g.aggregation(1).method in _STREAMS_START_AS_STANDARD
    for a in g.aggregations():
        if a.method not in _UNIFORM_AT_INIT:
            return False
        covered = []
        for s in a.sources:
            node = g.node(s)
            if isinstance(node, (BlockSum, Partial)):
                covered += node.members
            elif isinstance(node, Sublayer):
                covered.append(node.index)
            else:
                covered.append(0)
        if sorted(covered) != list(range(a.index)):
            return False
    return True


def step0_models(model, topology: T.Topology, dtype=torch.float32, seed: int = 0):
    """(the topology's fresh model, the standard-residual model) with the same embedding,
    sublayers and head; both eager, in `dtype`. `model` is a ModelSpec. Both are initialised
    as `restopo train` with this seed initialises (restopo.nn.init.Init(seed): each unit
    from a generator seeded by (seed, unit name)), so the topology's model is the run's own
    step 0."""
    torch.manual_seed(seed)
    standard = build_model(model, T.standard(tuple(model.kinds)), backend="eager",
                           init=Init(seed))
    torch.manual_seed(seed)
    other = build_model(model, topology, backend="eager", init=Init(seed))
    missing, unexpected = other.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("aggregations.") for k in missing)
    return other.to(dtype), standard.to(dtype)


@torch.no_grad()
def step0_difference(other: torch.nn.Module, standard: torch.nn.Module,
                     idx: torch.Tensor) -> float:
    """max |logits - standard logits| / max |standard logits| on the tokens `idx`."""
    want = standard(idx)
    return ((other(idx) - want).abs().max() / want.abs().max()).item()


def step0_report(model, topology: T.Topology, g: IR, idx: torch.Tensor, seed: int = 0) -> dict:
    """The step-0 check for `restopo diagnose`: the measured difference in float32, whether
    the topology should start as the standard model, and one line saying so."""
    other, standard = step0_models(model, topology, torch.float32, seed)
    diff = step0_difference(other, standard, idx)
    expected = starts_as_standard(g)
    tol = STANDARD_AT_INIT_TOLERANCE[torch.float32]
    if expected and diff <= tol:
        line = (f"step 0: equals the standard residual (max logit difference {diff:.1e} of "
                f"the logit scale, float32), as it should")
    elif expected:
        line = (f"step 0: DIFFERS from the standard residual by {diff:.2g} of the logit scale "
                f"(float32), though this topology should start as it: check the norm "
                f"epsilon and the initialisation (README: starting as the standard model)")
    else:
        line = (f"step 0: differs from the standard residual by {diff:.2g} of the logit "
                f"scale (float32), as expected: {_why_not_standard(g)}")
    return {"difference": diff, "expected_equal": expected, "tolerance": tol, "line": line}


def _why_not_standard(g: IR) -> str:
    """Why a topology that does not start as the standard residual does not."""
    first = g.aggregation(1)
    if first.multi_stream:  # mHC, mHC-lite (hyper.md section 11)
        return (f"{first.method}'s small random phi makes its read and write weights depend "
                "on the token, an O(alpha phi) change that lets the streams come apart (with "
                "phi = 0 they never would)")
    return f"{g.topology} does not weigh every earlier output alike at initialisation"
