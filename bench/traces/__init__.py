"""One reader for the real traces in ../shared/traces, and the fleet overlays that put them on a
fleet clock (issue 39, part 1).

Data flow: a trace path the caller names -> `read_sessions` (Claude Code session files in a
folder or a tarball, Mooncake JSONL, Azure CSV; streamed one session at a time) ->
`TraceSession`s of `TraceRequest`s (time, input and output tokens, prefix block ids with their
block size, think time; subagents as sessions of their own sharing their root's block ids) ->
an overlay chosen by the caller (`poisson_starts`, `ramp_starts`, `burst_starts`,
`trace_starts` driven by `mooncake_arrivals`; `think_scaled`) -> `fleet_requests`: one
time-ordered stream of `FleetRequest`s, each with its session instance and block id scope.
Pure Python and numpy; nothing here writes a file.
"""

from bench.traces.overlay import (
    burst_starts,
    fleet_requests,
    mean_duration_s,
    placement_order,
    poisson_starts,
    ramp_starts,
    rate_for_live_sessions,
    shaped_starts,
    think_scaled,
    think_shrink,
    trace_starts,
)
from bench.traces.read import (
    SessionPool,
    TraceFormatError,
    azure_arrivals,
    claude_members,
    mooncake_arrivals,
    parse_claude_session,
    read_azure,
    read_claude_sessions,
    read_mooncake,
    read_sessions,
)
from bench.traces.records import FleetRequest, TraceRequest, TraceSession

__all__ = [
    "FleetRequest",
    "SessionPool",
    "TraceFormatError",
    "TraceRequest",
    "TraceSession",
    "azure_arrivals",
    "burst_starts",
    "claude_members",
    "fleet_requests",
    "mean_duration_s",
    "mooncake_arrivals",
    "parse_claude_session",
    "placement_order",
    "poisson_starts",
    "ramp_starts",
    "rate_for_live_sessions",
    "read_azure",
    "read_claude_sessions",
    "read_mooncake",
    "read_sessions",
    "shaped_starts",
    "think_scaled",
    "think_shrink",
    "trace_starts",
]
