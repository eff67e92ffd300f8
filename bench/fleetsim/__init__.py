"""Discrete-event fleet simulator for prefill/decode fleets under coding-agent traffic.

``engine`` runs the fleet in vectorised time steps; ``workload`` generates sessions or replays
JSONL traces; ``policies`` holds the planners compared in ``bench/planner.py``. Needs numpy
(imported lazily by users of this package only; the operator's planner does not import it).
"""

from .engine import FleetConfig, FleetView, Metrics, SimResult, Simulator, simulate
from .workload import Modifier, SessionMix, SessionWorkload, Trace, parse_trace, read_trace

__all__ = [
    "FleetConfig",
    "FleetView",
    "Metrics",
    "Modifier",
    "SessionMix",
    "SessionWorkload",
    "SimResult",
    "Simulator",
    "Trace",
    "parse_trace",
    "read_trace",
    "simulate",
]
