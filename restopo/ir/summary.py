"""The JSON form of `restopo inspect`: the IR's analyses gathered in one dict."""
from __future__ import annotations

from .analyses import (added_parameters, display_name, live_values_per_token,
                       two_phase_live_values, two_phase_plan)
from .graph import IR
from .memory_io import best_two_phase_full, residual_io


def summary(g: IR) -> dict:
    """The JSON form of `restopo inspect`."""
    aggs = []
    for a in g.aggregations():
        entry = {"index": a.index, "before": a.before, "method": a.method,
                 "sources": [display_name(g, s) for s in a.sources]}
        if a.method == "attend":
            entry.update(query=a.query, gate=a.gate, key_norm=a.key_norm, heads=a.heads)
        elif a.method == "scalars":  # none: DenseFormer's raw weights; else normalised
            entry.update(gate=a.gate)
        elif a.multi_stream and a.is_head:  # the head sums the streams: no coefficients
            entry.update(method="sum", streams=a.streams)
        elif a.multi_stream:
            entry.update(streams=a.streams)
            if a.method == "hyper_connections":
                entry.update(dynamic=a.dynamic)
            if a.method == "mhc":
                entry.update(sinkhorn=a.sinkhorn)
        aggs.append(entry)
    return {
        "topology": g.topology,
        "sublayers": g.n_sublayers,
        "blocks": len(g.blocks),
        "block_sizes": [len(b) for b in g.blocks],
        "live_values_per_token": live_values_per_token(g),
        "live_values_two_phase": two_phase_live_values(g),
        "added_parameters": added_parameters(g) if g.width else None,
        "two_phase_groups": [list(p.members) for p in two_phase_plan(g)],
        "residual_io": _io(g),
        "aggregations": aggs,
    }


def _io(g: IR) -> dict:
    """Residual memory I/O per token per sublayer (restopo.ir.memory_io), and for direct
    static softmax attention the paper's two-phase schedule at its best group size."""
    out = residual_io(g).to_json()
    grouped = best_two_phase_full(g)
    if grouped is not None:
        out["two_phase_full"] = grouped.to_json()
    return out
