"""Real sessions as the fleet simulator replays them: closed-loop chains of real requests.

Data flow: `bench.traces` sessions (a folder or tarball of Claude Code session files, think
times scaled by the caller) -> `SimSession.of` (per session: its requests in chains, the root
session's and each subagent's, with their input and output tokens, think times, prompt block
counts and leaf block ids in the session's `BlockTrie`) -> `SessionTraffic` (the sessions
placed at start times a caller's overlay chose, `bench.traces.overlay`) -> the simulator asks
`due` for the requests released in a step and calls `finished` when a request's answer ends.

Closed loop, as an agent behaves: a chain's next request is released its trace think time
after the previous request's answer ended on the simulated fleet (so a slow fleet slows its
sessions down, as real agents wait for answers); a subagent's chain starts when the parent
request before it in the trace has been answered, plus the gap the trace shows. Requests that
overlapped in the trace run one after the other. A session placed before the run's start
(steady state) joins at its first request at or after time 0; its previous request's blocks
are handed to `warm` so the caches start as they would after it.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.traces import TraceSession, read_claude_sessions, think_scaled

from .prefixcache import BlockTrie

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
BLOCK_SIZE = 64  # the Claude Code traces' block size


@dataclass(frozen=True, eq=False)
class SimSession:
    """One top-level session and its subagents, reduced to what the simulator replays.

    Requests are numbered chain by chain: chain ``c`` holds requests ``first[c]`` to
    ``first[c + 1] - 1`` in order. ``offset[c]`` is the chain's start on the session's clock;
    a subagent chain (``c > 0``) starts ``gap[c]`` after request ``anchor[c]`` (a request of an
    earlier chain, -1 for the session's start) is answered."""

    key: str
    trie: BlockTrie
    input_tokens: I64
    output_tokens: I64
    think_s: F64
    blocks: I64  # full prompt blocks
    leaf: I64  # the prompt's last block id (0 without a full block)
    t: F64  # the request's time on the session's clock (the trace's, think times scaled)
    first: I64  # per chain, its first request; one more entry: the request count
    offset: F64
    anchor: I64
    gap: F64
    duration_s: float

    @property
    def chains(self) -> int:
        return len(self.first) - 1

    def chain_of(self, request: int) -> int:
        return bisect.bisect_right(self.first.tolist(), request) - 1

    @classmethod
    def of(cls, session: TraceSession) -> SimSession:
        members = list(session.family())
        rows: list[tuple[float, int, float, int, int, float, int]] = []
        first, offset, anchor, gap = [], [], [], []
        paths = []
        for offset_s, member in members:
            first.append(len(rows))
            offset.append(offset_s)
            for r in member.requests:
                paths.append(r.block_ids)
                leaf = int(r.block_ids[-1]) if len(r.block_ids) else 0
                rows.append(
                    (r.t, r.input_tokens, r.think_s, len(r.block_ids), leaf, r.api_s or 0.0,
                     r.output_tokens)
                )  # fmt: skip
        first.append(len(rows))
        t_abs = np.array(
            [
                offset[c] + rows[k][0]
                for c in range(len(members))
                for k in range(first[c], first[c + 1])
            ]
        )
        for c, (offset_s, _) in enumerate(members):
            if c == 0:
                anchor.append(-1)
                gap.append(0.0)
                continue
            # the last request of an earlier chain (the parent's) answered before this chain
            # starts: the one whose tool call spawned it
            ends = t_abs[: first[c]] + np.array([rows[k][5] for k in range(first[c])])
            before = np.flatnonzero(ends <= offset_s)
            k = int(before[np.argmax(ends[before])]) if before.size else -1
            anchor.append(k)
            gap.append(max(offset_s - (float(ends[k]) if k >= 0 else 0.0), 0.0))
        cols = list(zip(*rows, strict=True)) if rows else [()] * 7
        return cls(
            key=session.key,
            trie=BlockTrie(paths),
            input_tokens=np.array(cols[1], dtype=np.int64),
            output_tokens=np.maximum(np.array(cols[6], dtype=np.int64), 1),
            think_s=np.array(cols[2], dtype=float),
            blocks=np.array(cols[3], dtype=np.int64),
            leaf=np.array(cols[4], dtype=np.int64),
            t=t_abs.astype(float) if len(t_abs) else np.zeros(0),
            first=np.array(first, dtype=np.int64),
            offset=np.array(offset, dtype=float),
            anchor=np.array(anchor, dtype=np.int64),
            gap=np.array(gap, dtype=float),
            duration_s=session.family_duration_s,
        )


@functools.lru_cache(maxsize=4)
def load_sessions(
    path: str, think_scale: float = 1.0, limit: int | None = None
) -> tuple[SimSession, ...]:
    """The sessions at `path` (a folder or a tarball of Claude Code session files; the first
    `limit`), think times scaled, ready for the simulator; cached per process."""
    return tuple(_load(Path(path), think_scale, limit))


def _load(path: Path, think_scale: float, limit: int | None) -> Iterable[SimSession]:
    for n, session in enumerate(read_claude_sessions(path)):
        if limit is not None and n >= limit:
            return
        yield SimSession.of(think_scaled(session, think_scale))


@dataclass(frozen=True)
class Placement:
    """A session placed on the fleet clock: ``start`` (may be before 0: already running)."""

    start: float
    session: int  # index into the traffic's sessions


@dataclass(frozen=True)
class Due:
    """Requests released in one step, in time order: the chain (`SessionTraffic` row), the
    release time, and the request's session and index in it."""

    chain: I64
    time: F64
    placement: I64
    request: I64


@dataclass(frozen=True)
class Warm:
    """A request answered before the run started, whose blocks the caches should hold."""

    time: float
    placement: int
    request: int


@dataclass
class SessionTraffic:
    """Placed sessions replayed in closed loop (module doc). One object per simulation run."""

    sessions: Sequence[SimSession]
    placements: Sequence[Placement]
    warm_horizon_s: float = 3600.0  # requests answered longer before the start warm nothing
    _next: list[float] = field(default_factory=list)  # per chain row: release time (inf: none)
    _req: list[int] = field(default_factory=list)  # per chain row: its next request
    _end: list[int] = field(default_factory=list)  # per chain row: one past its last request
    _placement: list[int] = field(default_factory=list)
    _pending: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _opened: int = 0  # placements whose start has come
    warm: list[Warm] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.placements = sorted(self.placements, key=lambda p: p.start)
        self._open_before(0.0, prepopulate=True)
        self.warm.sort(key=lambda w: w.time)

    def session(self, placement: int) -> SimSession:
        return self.sessions[self.placements[placement].session]

    def scope(self, placement: int) -> str:
        return f"{self.session(placement).key}@{placement}"

    # ------------------------------------------------------------ chains

    def _chain(self, placement: int, c: int, release: float, request: int | None = None) -> None:
        s = self.session(placement)
        self._next.append(release)
        self._req.append(int(s.first[c]) if request is None else request)
        self._end.append(int(s.first[c + 1]))
        self._placement.append(placement)

    def _open_before(self, t1: float, prepopulate: bool = False) -> None:
        """Start the chains of placements whose start is before ``t1``."""
        while self._opened < len(self.placements) and self.placements[self._opened].start < t1:
            k = self._opened
            self._opened += 1
            start = self.placements[k].start
            if start >= 0.0 or not prepopulate:
                self._open(k, start)
            else:
                self._join(k, start)

    def _open(self, k: int, start: float) -> None:
        s = self.session(k)
        self._chain(k, 0, start)
        for c in range(1, s.chains):
            self._pending.setdefault((k, int(s.anchor[c])), []).append(c)
        for c in self._pending.pop((k, -1), []):
            self._chain(k, c, start + float(s.gap[c]))

    def _join(self, k: int, start: float) -> None:
        """A session that started before the run: each chain joins at its first request at or
        after 0 on the session's own clock (the request before it warms the caches); a chain
        that starts after 0 waits for its anchor when that is answered in the run."""
        s = self.session(k)
        live_anchor: set[int] = set()
        for c in range(s.chains):
            lo, hi = int(s.first[c]), int(s.first[c + 1])
            at = start + s.t[lo:hi]
            joined = int(np.searchsorted(at, 0.0, side="left"))
            anchored = c > 0 and int(s.anchor[c]) in live_anchor
            if anchored:
                self._pending.setdefault((k, int(s.anchor[c])), []).append(c)
                continue
            if joined < hi - lo:
                self._chain(k, c, float(at[joined]), lo + joined)
                live_anchor.update(range(lo + joined, hi))
            if joined > 0 and at[joined - 1] >= -self.warm_horizon_s:
                self.warm.append(Warm(float(at[joined - 1]), k, lo + joined - 1))

    # ------------------------------------------------------------ the simulator's calls

    def due(self, t1: float) -> Due:
        """Requests released before ``t1`` (their chains wait for the answer)."""
        self._open_before(t1)
        nxt = np.asarray(self._next)
        rows = np.flatnonzero(nxt < t1)
        rows = rows[np.argsort(nxt[rows], kind="stable")]
        req = np.array([self._req[r] for r in rows], dtype=np.int64)
        times = nxt[rows].copy()
        for r in rows.tolist():
            self._next[r] = math.inf
        placement = np.array([self._placement[r] for r in rows], dtype=np.int64)
        return Due(rows.astype(np.int64), times, placement, req)

    def retry(self, chains: I64, at: F64) -> None:
        """Refused requests are sent again at ``at``."""
        for r, t in zip(chains.tolist(), at.tolist(), strict=True):
            self._next[r] = t

    def finished(self, chains: I64, t_end: F64) -> list[float]:
        """The requests of ``chains`` were answered at ``t_end``: each chain's next request is
        released after its think time; subagents anchored on the request start. Returns the
        think times of the requests released."""
        thinks = []
        for r, t in zip(chains.tolist(), t_end.tolist(), strict=True):
            k, done = self._placement[r], self._req[r]
            s = self.session(k)
            for c in self._pending.pop((k, done), []):
                self._chain(k, c, t + float(s.gap[c]))
            nxt = done + 1
            if nxt < self._end[r]:
                self._req[r] = nxt
                self._next[r] = t + float(s.think_s[nxt])
                thinks.append(float(s.think_s[nxt]))
            else:
                self._next[r] = math.inf
        return thinks

    def live_chains(self) -> int:
        return int(np.isfinite(np.asarray(self._next)).sum()) if self._next else 0


def mean_duration(sessions: Sequence[SimSession]) -> float:
    return float(np.mean([s.duration_s for s in sessions])) if sessions else 0.0


def requests_per_session_second(sessions: Sequence[SimSession]) -> float:
    """Requests per second one live session sends on the traces' own clock."""
    total = sum(len(s.input_tokens) for s in sessions)
    return total / max(sum(s.duration_s for s in sessions), 1e-9)
