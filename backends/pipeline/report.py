"""The pipeline plan for people and for JSON: `restopo inspect FILE --pipeline PxV`.

`to_json` gives a Plan as plain numbers and names, `describe` as a table, and
`inspect_section` plans the pipeline a spec asks for (a PlanError says why it cannot; the
command prints it as a usage error).
"""
from __future__ import annotations

import math

import networkx as nx

from .plan import Plan, make_plan, model_costs, parse_pv
from restopo.words import counted


def to_json(plan: Plan) -> dict:
    """The plan as plain numbers and names (the JSON form of `restopo inspect --pipeline`)."""
    n_p = plan.uniform_np
    out = {
        "stages": plan.stages, "virtual": plan.virtual, "chunks": plan.n_chunks,
        "topology": plan.topology, "blocks": plan.n_blocks, "width": plan.width,
        "dtype_bytes": plan.dtype_bytes, "blocks_per_chunk": n_p,
        "chunk_table": [
            {"chunk": c.index, "rank": c.rank, "virtual": c.virtual,
             "sublayers": [c.sublayers[0], c.sublayers[-1]], "cost": c.cost,
             "blocks_completed": list(c.blocks_completed), "embedding": c.embedding,
             "head": c.head}
            for c in plan.chunks],
        "hops": [
            {"from_chunk": h.src, "to_chunk": h.src + 1, "from_rank": h.src_rank,
             "to_rank": h.dst_rank, "naive": [v.name for v in h.naive],
             "cached": [v.name for v in h.cached],
             "naive_vectors": sum(v.size for v in h.naive),
             "cached_vectors": sum(v.size for v in h.cached)}
            for h in plan.hops],
        "totals": {},
    }
    for mode, cached in (("naive", False), ("cached", True)):
        out["totals"][mode] = {
            "vectors_per_token": plan.vectors(cached),
            "bytes_per_token": plan.bytes_per_token(cached),
            "embedding": plan.vectors(cached, "embedding"),
            "blocks": plan.vectors(cached, "block"),
            "sublayer_outputs": plan.vectors(cached, "sublayer"),
            "hidden": plan.vectors(cached, "hidden"),
            "streams": plan.vectors(cached, "streams"),  # n streams, part of hidden
        }
    out["totals"]["paper_bound_blocks"] = plan.paper_bound_blocks
    return out


def describe(plan) -> str:
    """The plan as a table a person reads (`restopo inspect FILE --pipeline PxV`); takes a
    Plan or its `to_json` dict."""
    d = to_json(plan) if isinstance(plan, Plan) else plan
    P, V, C = d["stages"], d["virtual"], d["chunks"]
    N = d["blocks"]
    lines = [f"pipeline {P}x{V}: {counted(C, 'chunk')} on {counted(P, 'rank')} "
             f"(chunk c on rank c mod {P}); topology {d['topology']}, {counted(N, 'block')}"]
    rows = [("chunk", "rank", "sublayers", "blocks done", "to next: naive", "to next: cached")]
    for c in d["chunk_table"]:
        a, b = c["sublayers"]
        extra = ("emb+" if c["embedding"] else "") + (f"{a}-{b}" if b > a else f"{a}") + \
            ("+head" if c["head"] else "")
        done = ",".join(f"b{n}" for n in c["blocks_completed"]) or "-"
        if c["chunk"] < C - 1:
            h = d["hops"][c["chunk"]]
            naive = f"{h['naive_vectors']}: {_names(h['naive'])}"
            cached = f"{h['cached_vectors']}: {_names(h['cached'])}"
        else:
            naive = cached = "-"
        rows.append((str(c["chunk"]), str(c["rank"]), extra, done, naive, cached))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)) + "  " + r[5])
    t = d["totals"]
    lines.append("totals (d-vectors per token, forward; backward sends the same again):")
    for label in ("naive", "cached"):
        m = t[label]
        b = m["bytes_per_token"]
        size = f" = {b} bytes/token at {d['dtype_bytes']} bytes/value" if b is not None else ""
        streams = m.get("streams", 0)
        lines.append(f"  {label:7s}{m['vectors_per_token']:6d}{size}  (embedding "
                     f"{m['embedding']}, blocks {m['blocks']}, sublayer outputs "
                     f"{m['sublayer_outputs']}, hidden partial {m['hidden'] - streams}"
                     + (f", n streams {streams}" if streams else "") + ")")
    n_p = d["blocks_per_chunk"]
    np_text = f"N_p = {n_p}" if n_p is not None else \
        f"chunks complete {[len(c['blocks_completed']) for c in d['chunk_table']]} blocks; " \
        "N_p taken as N/C"
    if not t["naive"]["blocks"]:  # the bound counts blocks a later stage reads: none here
        lines.append("  block transfers: none (no stage reads a block completed before it)")
    else:
        lines.append(f"  block transfers: naive {t['naive']['blocks']}, cached "
                     f"{t['cached']['blocks']}, paper's bound P(P-1)/2 N_p + (V-1) P^2 N_p = "
                     f"{_num(t['paper_bound_blocks'])}  ({np_text})")
    if t["naive"]["vectors_per_token"]:
        lines.append(f"  cached / naive = "
                     f"{t['cached']['vectors_per_token'] / t['naive']['vectors_per_token']:.3f}")
    return "\n".join(lines)


def _names(names, limit: int = 8) -> str:
    return ",".join(names) if len(names) <= limit else \
        ",".join(names[:limit - 1]) + f",...(+{len(names) - limit + 1})"


def _num(x: float) -> str:
    return str(int(x)) if math.isclose(x, round(x)) else f"{x:.2f}"


def inspect_section(spec, g: nx.DiGraph, pv: str) -> dict:
    """The `pipeline` section of `restopo inspect FILE --pipeline PxV` (a JSON dict). Raises
    PlanError when the pipeline cannot be planned."""
    P, V = parse_pv(pv)
    model = spec.model
    return to_json(make_plan(g, P, V, **(model_costs(model, g) if model is not None else {})))
