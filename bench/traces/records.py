"""The typed records every trace reader yields (pure): requests, sessions, fleet requests.

A `TraceSession` is one agent conversation on its own clock: its requests' `t` are seconds from
its first request. A Claude Code session's nested subagents are sessions of their own
(`subagents`, each starting `start_s` into its parent's clock) whose block ids share the root
session's id space (`root`), so a block is keyed by `(root, block id)` everywhere.
`overlay.fleet_requests` puts sessions on a fleet clock and yields `FleetRequest`s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

BlockIds = npt.NDArray[np.int64]

NO_BLOCKS: BlockIds = np.zeros(0, dtype=np.int64)
NO_BLOCKS.setflags(write=False)


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """One request of a session.

    `block_ids` are the prompt's prefix block ids, one per full `block_size`-token block (two
    prompts of one `root` share ids exactly as far as their token prefixes are equal); the
    prompt's last `fresh_tail_tokens` tokens are in no block. `think_s` is the tool or human
    time before this request; `api_s` the time the provider took to answer (None when the
    trace does not say)."""

    t: float
    input_tokens: int
    output_tokens: int
    block_ids: BlockIds
    block_size: int
    think_s: float = 0.0
    api_s: float | None = None
    kind: str = ""  # the trace's request type (Claude Code: "n", "s")

    @property
    def fresh_tail_tokens(self) -> int:
        """Prompt tokens after the last full block (a fresh suffix no other prompt shares)."""
        return max(self.input_tokens - self.block_size * len(self.block_ids), 0)

    @property
    def block_tokens(self) -> int:
        """Prompt tokens covered by `block_ids`."""
        return self.block_size * len(self.block_ids)


@dataclass(frozen=True, eq=False)
class TraceSession:
    """One session: its requests in order, on its own clock (`t` from its first request).

    `root` names the block id space (the top-level session); `start_s` is where this session
    starts on its parent's clock (0 for a top-level session)."""

    key: str
    root: str
    requests: tuple[TraceRequest, ...]
    start_s: float = 0.0
    subagents: tuple[TraceSession, ...] = ()
    source: str = ""

    @property
    def duration_s(self) -> float:
        """From the first request to the end of the last (its answer time when known)."""
        if not self.requests:
            return 0.0
        last = self.requests[-1]
        return last.t + (last.api_s or 0.0)

    @property
    def family_duration_s(self) -> float:
        """`duration_s`, or longer when a subagent ends after this session's last request."""
        ends = [self.duration_s]
        ends += [s.start_s + s.family_duration_s for s in self.subagents]
        return max(ends)

    def family(self, offset_s: float = 0.0) -> Iterator[tuple[float, TraceSession]]:
        """This session and every nested subagent, each with its start on this clock."""
        yield offset_s, self
        for sub in self.subagents:
            yield from sub.family(offset_s + sub.start_s)


@dataclass(frozen=True, eq=False)
class FleetRequest:
    """A request placed on a fleet clock by an overlay (`overlay.fleet_requests`).

    `session` is unique per session instance on the fleet (a trace session replayed twice is
    two sessions); `scope` names its block id space, so `(scope, block id)` is a block's key
    across the fleet; `turn` is the request's index in its session (0: the first turn)."""

    time_s: float
    session: str
    scope: str
    turn: int
    request: TraceRequest = field(repr=False)
