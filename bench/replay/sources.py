"""What a replay sends: session instances with their start times and block id scopes (pure
but for reading the trace).

- Claude Code sessions (the kv-cache-tester format: a folder or tarball of session files):
  `claude_source` places `count` session instances at Poisson starts of `rate` per second,
  sessions in a seeded random order (each once before any repeats); each instance has its own
  block id scope (`key@n`), as the trace's ids are per session;
- Mooncake's JSONL (one request a line, one id space for the whole trace): `mooncake_source`
  takes its first `count` requests at the trace's own arrival times rescaled to `rate`
  requests per second (`overlay.trace_starts`), all in one scope, so prefixes shared across
  requests are shared in the replay too.

`open_source` picks by the path (``.jsonl``: Mooncake; else Claude Code sessions).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.traces import (
    SessionPool,
    TraceSession,
    placement_order,
    poisson_starts,
    read_mooncake,
    trace_starts,
)


@dataclass(frozen=True)
class Placement:
    """One session instance: which trace session, when it starts (s), its block id scope."""

    key: str
    start_s: float
    scope: str


@dataclass(frozen=True)
class Source:
    """The instances to replay, in start order, and how to get each one's session."""

    format: str
    places: list[Placement]
    session: Callable[[str], TraceSession]

    @property
    def sessions(self) -> int:
        return len({p.key for p in self.places})


def placements(keys: list[str], rate: float, count: int, seed: int) -> list[Placement]:
    """`count` session instances at Poisson starts of `rate`/s (rate 0: all at once), in a
    seeded random order (each distinct before any repeats; a repeat is a new scope)."""
    starts = np.zeros(count)
    horizon = 1.0
    while rate > 0 and len(starts := poisson_starts(rate, horizon, seed)) < count:
        horizon *= 2  # long enough for `count` starts
    starts = np.sort(starts)[:count]
    order = placement_order(len(keys), count, seed)
    return [
        Placement(keys[i], float(t), f"{keys[i]}@{n}")
        for n, (t, i) in enumerate(zip(starts, order, strict=True))
    ]


def claude_source(pool: SessionPool, rate: float, count: int, seed: int) -> Source:
    return Source("claude-code", placements(pool.keys, rate, count, seed), pool.session)


def mooncake_source(path: str | Path, rate: float, count: int) -> Source:
    sessions = {s.key: s for s in itertools.islice(read_mooncake(path), count)}
    arrivals = np.array([s.start_s for s in sessions.values()], dtype=float)
    starts = trace_starts(arrivals, rate if rate > 0 else None)
    keys = sorted(sessions, key=lambda k: sessions[k].start_s)  # stable: the file's order
    places = [Placement(k, float(t), sessions[k].root) for k, t in zip(keys, starts, strict=True)]
    return Source("mooncake", places, sessions.__getitem__)


def open_source(path: str | Path, rate: float, count: int, seed: int, limit: int = 200) -> Source:
    """The replay of the trace at `path` (module doc); `limit` sessions read at most (Claude)."""
    if str(path).endswith(".jsonl"):
        return mooncake_source(path, rate, count)
    pool = SessionPool.load(path, limit=limit)
    if len(pool) == 0:
        raise ValueError(f"{path}: no Claude Code sessions")
    return claude_source(pool, rate, count, seed)
