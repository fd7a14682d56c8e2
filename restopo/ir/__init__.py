"""The topology IR (networkx; no torch needed), the analyses read from it, and the one walk
that turns it into computation.

    build_ir(kinds, topology, width) -> IR     the graph, typed nodes (restopo.ir.nodes)
    live_values_per_token, added_parameters, mixing_matrix, two_phase_plan, summary,
    residual_io (memory I/O per sublayer), ...
    walk(ir, visitor)                           visit the IR in execution order
"""
from .analyses import (PhaseGroup, added_parameters, aggregations, display_name,
                       is_multi_stream, is_stream, live_values_per_token, mixing_matrix,
                       sources, stream_fed, two_phase_plan)
from .build import TopologyError, build_ir
from .graph import IR
from .memory_io import residual_io
from .nodes import (Aggregation, BlockSum, Embedding, Head, Node, Partial, Streams, Sublayer,
                    Value)
from .summary import summary

__all__ = ["TopologyError", "build_ir", "IR", "PhaseGroup", "added_parameters", "aggregations",
           "display_name", "is_multi_stream", "is_stream", "live_values_per_token",
           "mixing_matrix", "residual_io", "sources", "stream_fed", "summary", "two_phase_plan",
           "Aggregation", "BlockSum", "Embedding", "Head", "Node", "Partial", "Streams",
           "Sublayer", "Value"]
