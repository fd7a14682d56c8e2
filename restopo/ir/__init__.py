"""The topology IR (networkx; no torch needed) and the analyses read from it."""
from .build import TopologyError, build_ir
from .analyses import (PhaseGroup, added_parameters, aggregations, display_name, is_stream,
                       live_values_per_token, mixing_matrix, sources, summary, two_phase_plan)

__all__ = ["TopologyError", "build_ir", "PhaseGroup", "added_parameters", "aggregations",
           "display_name", "is_stream", "live_values_per_token", "mixing_matrix", "sources",
           "summary", "two_phase_plan"]
