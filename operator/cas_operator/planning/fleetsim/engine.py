"""Vectorised fleet simulator for prefill/decode LLM fleets under coding-agent traffic.

Time advances in fixed steps of ``dt`` seconds; within a step every event is handled as a batch
with numpy, and event times inside a step are kept exact where they are determined at arrival:

- Arrivals: sessions whose next turn falls in the step (closed loop), new sessions (Poisson), or
  trace requests (open loop).
- Routing (prefix-aware): a returning turn whose prefix is still cached on its home prefill
  instance goes there; otherwise to the least-backlogged ready instance (only the shared system
  prefix is cached there). Tiers: GPU and host (HiCache, loaded at the profile's load rate).
- Prefill: each instance is a FIFO server (chunked prefill over cached context is in the
  profile's time function); finish times come from the Lindley recursion, vectorised over all
  instances with a segmented running maximum.
- KV transfer: the whole context leaves through the prefill instance's NIC, FIFO per instance.
- Decode: a request is admitted when its context fits in a decode instance's free KV (else it
  waits: that time counts toward TTFT); each step every instance advances its batch by
  ``dt / step_time(batch, total context) * accept_length`` tokens; KV overflow from growth
  retracts the newest requests back to the wait queue.
- Caches: per-instance LRU over sessions, recomputed every ``evict_every_s`` (GPU tier, then host
  tier); finished sessions keep occupying space until evicted.
- Control: every ``tick_s`` a policy sees metrics from ``metric_lag_s`` ago and returns target
  replicas; new pods hold GPUs but serve nothing until ``pod_start_s``; removed pods stop taking
  work at once and leave after ``drain_s`` (their cache is lost).

Pure computation (no I/O, no clock). Outputs per-request records and a per-tick time series.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cas_operator.planning.ratio import InstanceProfile

from .workload import SessionWorkload, Trace, lognormal

OFF, STARTING, READY, DRAINING = 0, 1, 2, 3
_BIG = 1e9


@dataclass(frozen=True)
class FleetConfig:
    """Fleet shape and simulation knobs."""

    prefill: InstanceProfile
    decode: InstanceProfile
    n_prefill: int
    n_decode: int
    max_prefill: int
    max_decode: int
    duration_s: float = 3600.0
    dt: float = 0.5
    evict_every_s: float = 5.0
    tick_s: float = 30.0
    metric_lag_s: float = 30.0
    metric_window_s: float = 60.0
    accept_multiplier: float = 1.0
    warmup_s: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class FleetView:
    """What a policy sees of the fleet: spec replicas and pods still holding GPUs."""

    prefill: int
    decode: int
    prefill_pods: int
    decode_pods: int


@dataclass(frozen=True)
class Metrics:
    """Window aggregates as a scraper would report them, ``metric_lag_s`` late."""

    arrival_rate: float
    hit_rate: float
    ttft_p90_s: float
    itl_ms: float
    avg_input_tokens: float
    p95_input_tokens: float
    avg_output_tokens: float
    first_turn_fraction: float
    tool_pause_s: float
    prefill_backlog_s: float
    decode_kv_usage: float
    decode_waiting: int


Policy = Callable[[float, Metrics, FleetView], tuple[int, int]]


@dataclass
class SimResult:
    """Per-request records (completed requests) and per-tick series."""

    arrival: np.ndarray
    ttft: np.ndarray
    itl: np.ndarray
    input_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    series: list[dict[str, float]] = field(default_factory=list)
    scale_actions: int = 0
    gpu_seconds: float = 0.0
    retractions: int = 0
    steps: int = 0
    duration_s: float = 0.0
    warmup_s: float = 0.0

    def goodput(self, ttft_s: float, itl_ms: float) -> dict[str, float]:
        """Requests meeting both SLOs after warm-up: rate, attainment, per-GPU rate."""
        m = self.arrival >= self.warmup_s
        ok = (self.ttft[m] <= ttft_s) & (self.itl[m] * 1000.0 <= itl_ms)
        span = max(self.duration_s - self.warmup_s, 1e-9)
        gpus = self.gpu_seconds / max(self.duration_s, 1e-9)
        good = float(ok.sum()) / span
        done = int(m.sum())
        return {
            "requests": float(done),
            "goodput_rps": good,
            "attainment": float(ok.mean()) if done else 0.0,
            "avg_gpus": gpus,
            "goodput_per_gpu": good / gpus if gpus else 0.0,
            "ttft_p90_s": float(np.quantile(self.ttft[m], 0.9)) if done else math.inf,
            "itl_p50_ms": float(np.median(self.itl[m]) * 1000.0) if done else math.inf,
            "hit_rate": float(self.cached_tokens[m].sum() / max(self.input_tokens[m].sum(), 1)),
        }


def fifo_finish(
    inst: np.ndarray, arrival: np.ndarray, service: np.ndarray, busy_until: np.ndarray
) -> np.ndarray:
    """FIFO finish times for jobs on many servers at once (updates ``busy_until`` in place).

    Lindley per server: ``f_k = max(f_{k-1}, a_k) + s_k`` with ``f_{-1} = busy_until``, unrolled
    as ``f_k = S_k + max(B, max_{j<=k}(a_j - S_{j-1}))`` (S = inclusive service cumsum within the
    server) and computed with one sort and a running maximum offset per server.
    """
    n = inst.size
    if n == 0:
        return np.empty(0)
    order = np.lexsort((arrival, inst))
    g, a, s = inst[order], arrival[order], service[order]
    csum = np.cumsum(s)
    first = np.ones(n, dtype=bool)
    first[1:] = g[1:] != g[:-1]
    seg_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    base = csum[seg_start] - s[seg_start]
    incl = csum - base
    excl = incl - s
    v = a - excl + g * _BIG
    m = np.maximum.accumulate(v) - g * _BIG
    fin = incl + np.maximum(busy_until[g], m)
    last = np.ones(n, dtype=bool)
    last[:-1] = g[:-1] != g[1:]
    busy_until[g[last]] = fin[last]
    out = np.empty(n)
    out[order] = fin
    return out


def spread(n: int, load: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Assign ``n`` jobs to eligible servers, least loaded first, round robin (-1 if none)."""
    idx = np.flatnonzero(eligible)
    if idx.size == 0 or n == 0:
        return np.full(n, -1, dtype=np.int64)
    ranked = idx[np.argsort(load[idx], kind="stable")]
    return ranked[np.arange(n) % ranked.size]


class _Records:
    """Growable float32 columns for completed requests."""

    names = ("arrival", "ttft", "itl", "input", "cached", "output")

    def __init__(self, cap: int) -> None:
        self.cols = {k: np.empty(cap, dtype=np.float64) for k in self.names}
        self.n = 0

    def add(self, **cols: np.ndarray) -> None:
        k = cols["arrival"].size
        if self.n + k > self.cols["arrival"].size:
            new = max(2 * self.cols["arrival"].size, self.n + k)
            for name in self.names:
                grown = np.empty(new, dtype=np.float64)
                grown[: self.n] = self.cols[name][: self.n]
                self.cols[name] = grown
        for name, v in cols.items():
            self.cols[name][self.n : self.n + k] = v
        self.n += k

    def view(self, name: str) -> np.ndarray:
        return self.cols[name][: self.n]


class _Pool:
    """Instance states of one role."""

    def __init__(self, n: int, cap: int) -> None:
        self.state = np.zeros(cap, dtype=np.int8)
        self.state[:n] = READY
        self.ready_at = np.zeros(cap)
        self.remove_at = np.full(cap, np.inf)
        self.busy = np.zeros(cap)
        self.link = np.zeros(cap)

    def spec(self) -> int:
        return int(((self.state == READY) | (self.state == STARTING)).sum())

    def pods(self) -> int:
        return int((self.state != OFF).sum())

    def scale(self, target: int, now: float, start_s: float, drain_s: float) -> int:
        """Move the spec count to ``target``; returns instances changed."""
        cur = self.spec()
        if target > cur:
            free = np.flatnonzero(self.state == OFF)[: target - cur]
            self.state[free] = STARTING
            self.ready_at[free] = now + start_s
            self.busy[free] = now + start_s
            self.link[free] = now + start_s
            return int(free.size)
        if target < cur:
            live = np.flatnonzero((self.state == STARTING) | (self.state == READY))
            # starting ones first, then least busy
            key = np.where(self.state[live] == STARTING, -np.inf, self.busy[live])
            pick = live[np.argsort(key, kind="stable")[: cur - target]]
            starting = pick[self.state[pick] == STARTING]
            self.state[starting] = OFF
            ready = pick[self.state[pick] == READY]
            self.state[ready] = DRAINING
            self.remove_at[ready] = now + drain_s
            return int(pick.size)
        return 0

    def advance(self, now: float) -> np.ndarray:
        """Start pods whose time has come; return instances removed at ``now``."""
        go = (self.state == STARTING) & (self.ready_at <= now)
        self.state[go] = READY
        gone = np.flatnonzero((self.state == DRAINING) & (self.remove_at <= now))
        self.state[gone] = OFF
        self.remove_at[gone] = np.inf
        return gone


class _Sessions:
    """Session (or trace conversation) state: next turn, context, cache home and tier."""

    def __init__(self, cap: int) -> None:
        self.n = 0
        self.live = np.zeros(cap, dtype=bool)
        self.next = np.full(cap, np.inf)
        self.ctx = np.zeros(cap)
        self.cached = np.zeros(cap)
        self.home = np.full(cap, -1, dtype=np.int64)
        self.tier = np.zeros(cap, dtype=np.int8)
        self.last = np.zeros(cap)
        self.turns = np.zeros(cap, dtype=np.int64)
        self.first = np.zeros(cap, dtype=bool)

    def alloc(self, k: int) -> np.ndarray:
        """Slots for ``k`` new sessions: reuse dead, uncached slots, else grow."""
        free = np.flatnonzero(~self.live[: self.n] & (self.home[: self.n] < 0))[:k]
        extra = k - free.size
        if extra > 0:
            if self.n + extra > self.live.size:
                self._grow(max(2 * self.live.size, self.n + extra))
            free = np.concatenate([free, np.arange(self.n, self.n + extra)])
            self.n += extra
        return free

    def _grow(self, cap: int) -> None:
        for name in ("live", "next", "ctx", "cached", "home", "tier", "last", "turns", "first"):
            old = getattr(self, name)
            fill = {"next": np.inf, "home": -1}.get(name, 0)
            new = np.full(cap, fill, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)


_REQ_FIELDS = (
    "sid",
    "arr",
    "ready",
    "inp",
    "inp0",
    "cached",
    "out",
    "gen",
    "first",
    "inst",
    "tried",
)


class _Requests:
    """A set of in-flight requests as parallel arrays (waiting or active decode)."""

    def __init__(self) -> None:
        self.cols: dict[str, np.ndarray] = {}
        for k in _REQ_FIELDS:
            dtype = np.int64 if k in ("sid", "inst") else (bool if k == "tried" else np.float64)
            self.cols[k] = np.empty(0, dtype=dtype)

    def __len__(self) -> int:
        return int(self.cols["sid"].size)

    def __getitem__(self, k: str) -> np.ndarray:
        return self.cols[k]

    def __setitem__(self, k: str, v: np.ndarray) -> None:
        self.cols[k] = v

    def take(self, mask: np.ndarray) -> dict[str, np.ndarray]:
        """Remove and return the rows in ``mask``."""
        out = {k: v[mask] for k, v in self.cols.items()}
        keep = ~mask
        self.cols = {k: v[keep] for k, v in self.cols.items()}
        return out

    def put(self, rows: dict[str, np.ndarray]) -> None:
        self.cols = {k: np.concatenate([v, rows[k]]) for k, v in self.cols.items()}
