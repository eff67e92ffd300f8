"""Vectorised fleet simulator for prefill/decode LLM fleets under coding-agent traffic.

Time advances in fixed steps of ``dt`` seconds; within a step every event is handled as a batch
with numpy, and event times inside a step are kept exact where they are determined at arrival:

- Arrivals: sessions whose next turn falls in the step (closed loop), new sessions (Poisson),
  trace requests (open loop), or real sessions' requests (`sessions.SessionTraffic`, closed
  loop: each request its think time after the previous answer).
- Routing as the product's routers route (``FleetConfig.routing``): sglang-router's
  `cache_aware` (`CacheAwareRouting`: a returning turn whose prefix an instance holds goes
  there; a new session, or one whose prefix no instance holds, to the instance caching the
  least, blind to load unless the instances' loads differ by over 64 requests); for real
  sessions also the keyed policies, smg's `consistent_hashing` (`ConsistentHashRouting`) and
  sglang-router's `manual` (`ManualRouting`). Caches: per session on its home instance
  (synthetic sessions), or per (session, block) on every instance for real sessions
  (`prefixcache`, exact LRU). Tiers: GPU and host (HiCache, loaded at the profile's load
  rate).
- Prefill: each instance admits requests FIFO while their whole contexts fit in its KV capacity
  (LayerSplit raises it); an admitted request loads its host-tier prefix (GPU free for others),
  then computes on the instance's one GPU queue (chunked prefill over cached context is in the
  profile's time function), then sends its KV; its KV stays resident until the send is done
  (``kv_bounded_prefill``, the bound ``model.closed_throughput`` predicts).
- KV transfer: the whole context leaves through the prefill instance's NIC, FIFO per instance.
- Decode: behind the keyed policies (`decodes_in_turn`) the router gives each
  request the next ready decode instance in turn and it waits there, FIFO, until its context
  fits in that instance's free KV (SGLang's decode prealloc queue); otherwise it goes to the
  instance with the most free KV when one has room. The wait counts toward TTFT. Each step
  every instance advances its batch by ``dt / step_time(batch, total context) *
  accept_length`` tokens; KV overflow from growth retracts the newest requests back to their
  instance's queue.
- Caches: per-instance LRU over sessions, recomputed every ``evict_every_s`` (GPU tier, then host
  tier); finished sessions keep occupying space until evicted.
- Control: every ``tick_s`` a policy sees metrics from ``metric_lag_s`` ago and returns target
  replicas; new pods hold GPUs but serve nothing until ``pod_start_s``; removed pods stop taking
  work at once and leave after ``drain_s`` (their cache is lost).
- Admission (``FleetConfig.admission``, the operator's `router.admission`): every tick the limit
  for the ready pools is set; arrivals take a token from a bucket refilled at its rate (holding
  its ``size``, by default ``ADMISSION_BURST_S`` of the rate); with an in-flight bound (smg's
  `--max-concurrent-requests`), the bucket holds that many and no arrival is admitted while
  that many requests are in flight (waiting for or in prefill, waiting for or in decode); with
  ``returns`` (sglang-router 0.3.2) a finished request gives its token back, up to the size
  (tests/engine/test_router_admission_real.py). An arrival refused is answered 429 at once and
  its session sends the turn again ``RETRY_AFTER_S`` later (counted in ``shed``).

Pure computation (no I/O, no clock). Outputs per-request records and a per-tick time series.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from cas_engine.prefixreuse import DEFAULT_GHOST_ENTRIES, DEFAULT_SAMPLE_RATE, REUSE_BUCKETS_S
from cas_operator.api.models import KEYED_POLICIES, RouterPolicy
from cas_operator.autoscale.model import InstanceProfile
from cas_operator.autoscale.reuse import ReuseProfile, profile_from_counts
from cas_operator.observe.types import rate_window

from .prefixcache import BlockTrie, InstanceCache, Overlap
from .sessions import BLOCK_SIZE, SessionTraffic
from .workload import SessionWorkload, Trace, draw_turns, lognormal

OFF, STARTING, READY, DRAINING = 0, 1, 2, 3
ADMISSION_BURST_S = 5.0  # desired.admission.BURST_SECONDS
RETRY_AFTER_S = 2.0  # a client's wait after a 429 (smg's Retry-After; an SDK's backoff)
# The engines' ghost map reaches this many blocks (cas_engine.prefixreuse: 2^18 tracked
# blocks, 1 in 16 tracked); the simulator's exact equivalent remembers as many.
GHOST_BLOCKS = DEFAULT_GHOST_ENTRIES * DEFAULT_SAMPLE_RATE
PREPOPULATE_DRAWS = 4000  # sessions drawn to pick the live ones of the steady state from


@dataclass(frozen=True)
class CacheAwareRouting:
    """How the product's router (`router.policy: cache_aware`, sglang-router 0.3.2's defaults,
    `sglang_router/router_args.py`) picks a prefill instance for real sessions: the instance
    with the longest cached prefix when it covers more than ``cache_threshold`` of the prompt,
    else the one with the smallest tree (the least cached), unless the loads are imbalanced
    (the busiest instance over ``balance_abs_threshold`` requests and ``balance_rel_threshold``
    times the idlest's), then the least loaded. The router's approximate tree is taken to
    mirror what the instance caches (its 2^26-character tree per worker holds about the tokens
    of a GPU plus host tier); the load is the requests in prefill on the instance."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    policy: ClassVar[RouterPolicy] = RouterPolicy.CACHE_AWARE


@dataclass(frozen=True)
class ConsistentHashRouting:
    """How the product's default router for real coding-agent traffic picks a prefill
    instance (`router.implementation: smg`, `router.policy` unset: smg 1.13's
    `consistent_hashing` on the session id the client sends): the session key is hashed onto a
    ring holding ``virtual_nodes`` points per worker (smg's WorkerRegistry: 150, blake3) and
    the request goes to the first ready instance clockwise, whatever the instances cache or
    hold. A new instance takes the keys of its arcs only (about 1/N of the sessions; their
    next turn re-prefills once); a removed one's keys move to its successors. Blake2b stands
    in for blake3 (any stable, uniform hash places the same way on average)."""

    virtual_nodes: int = 150
    policy: ClassVar[RouterPolicy] = RouterPolicy.CONSISTENT_HASHING

    def points(self, instance: int) -> list[tuple[int, int]]:
        """The ring points of ``instance`` (a pod keeps its index, as its name, while it
        lives): (position, instance)."""
        return [
            (_ring_hash(f"prefill-{instance}#{v}"), instance) for v in range(self.virtual_nodes)
        ]


def _ring_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class ManualRouting:
    """How sglang-router 0.3.2 picks a prefill instance with `router.policy` unset (its
    `manual` policy on the session id the client sends): each of the ``replicas`` router pods
    keeps its own map from session key to instance, filled with a random ready instance the
    first time that pod sees the key or when its instance is gone; each request reaches one
    pod at random (kube-proxy spreads connections over the entry Service), so with two pods
    a session's requests alternate between up to two instances (docs/traffic.md)."""

    replicas: int = 2
    policy: ClassVar[RouterPolicy] = RouterPolicy.MANUAL


Routing = CacheAwareRouting | ConsistentHashRouting | ManualRouting


def decodes_in_turn(routing: Routing) -> bool:
    """Whether the fleet's decodes go round robin, each request waiting for KV on the decode it
    was given: behind the keyed policies, which the operator runs with `--decode-policy
    round_robin` (`cas_operator.desired.resources.router.policy_args`), since SGLang's decode
    admits its prealloc queue FIFO, stopping at the first request whose KV does not fit
    (sglang 0.5.23 srt/disaggregation/decode.py:1333, pop_preallocated; :1580). Pooled (any
    decode with room takes the next request), the simulator served 8.99 req/s at 26P:6D on
    real sessions' high load where round robin serves 7.86, and put the best split one decode
    instance short (bench.planner_traces). Otherwise (`cache_aware`, the synthetic
    benchmarks' router) the decode with the most free KV, chosen again while a request
    waits: not what sglang-router does (with no `--decode-policy` its cache_aware tree also
    picks decodes, by the session's prefix)."""
    return routing.policy in KEYED_POLICIES


# The routers' policies by the name `router.policy` gives them (the benchmarks' ``--router``).
ROUTINGS: dict[str, Routing] = {
    "cache_aware": CacheAwareRouting(),
    "consistent_hashing": ConsistentHashRouting(),
    "manual": ManualRouting(),
}


@dataclass(frozen=True)
class Limit:
    """What the routers admit, as one bucket for the fleet: refilled at `rate` per second,
    holding `size` (default: smg's in-flight bound, else 5 s of the rate); `in_flight`: smg's
    bound on the requests in flight; `returns`: sglang-router 0.3.2's bucket, which gets a
    token back when a response ends."""

    rate: float
    in_flight: float = math.inf
    size: float | None = None
    returns: bool = False

    @property
    def bucket(self) -> float:
        """The burst the bucket holds."""
        if self.size is not None:
            return max(1.0, self.size)
        if math.isfinite(self.in_flight):
            return max(1.0, self.in_flight)
        return max(1.0, self.rate * ADMISSION_BURST_S)


# The limit for (ready prefill, ready decode) instances; None: no limit.
Admission = Callable[[int, int], Limit | None]


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
    prepopulate: bool = True  # start with steady-state sessions (cold caches)
    seed: int = 0
    admission: Admission | None = None
    routing: Routing = CacheAwareRouting()  # keyed policies: real sessions only


@dataclass(frozen=True)
class FleetView:
    """What a policy sees of the fleet: spec replicas and pods still holding GPUs."""

    prefill: int
    decode: int
    prefill_pods: int
    decode_pods: int
    ready_prefill: int | None = None  # serving now (None: as `prefill`)
    ready_decode: int | None = None

    @property
    def ready(self) -> tuple[int, int]:
        """(prefill, decode) instances serving now."""
        p = self.prefill if self.ready_prefill is None else self.ready_prefill
        return p, self.decode if self.ready_decode is None else self.ready_decode


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
    decode_waiting: int  # requests whose KV has arrived but that wait for decode admission
    refused_rate: float = 0.0  # arrivals answered 429 by admission per second, retries too
    # the prefill engines' prompt reuse times over the window (real sessions only), as the
    # operator sums `cas_prefix_*` (`autoscale.signals.prompt_reuse`)
    reuse: ReuseProfile | None = None
    # arrivals over the last `observe.types.rate_window` of the window, as the operator counts
    # `recent_requests` (what its trend and variation read)
    recent_arrival_rate: float | None = None


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
    peak_gpus: int = 0
    retractions: int = 0
    shed: int = 0  # arrivals answered 429 by admission (each retried by its session)
    steps: int = 0
    duration_s: float = 0.0
    warmup_s: float = 0.0
    reuse: list[ReuseProfile | None] = field(default_factory=list)  # per series row (sessions)

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


@dataclass(frozen=True)
class PrefillTimes:
    """Per request: when its prefill compute ends and when its KV has reached decode."""

    computed: np.ndarray
    sent: np.ndarray


def kv_bounded_prefill(
    inst: np.ndarray,
    arrival: np.ndarray,
    load_s: np.ndarray,
    busy_s: np.ndarray,
    send_s: np.ndarray,
    tokens: np.ndarray,
    capacity_tokens: float,
    pool: _Pool,
) -> PrefillTimes:
    """Exact per-instance recursion of prefill with resident-KV admission (updates ``pool``).

    In arrival order per instance: admit when the request's ``tokens`` fit beside the KV of the
    requests still resident (FIFO: never before the previous admission), load its host-tier
    prefix for ``load_s``, compute for ``busy_s`` once the GPU is free, send for ``send_s`` once
    the NIC is free, release its KV when sent. A context larger than the whole capacity is
    admitted alone (SGLang would refuse it; the sim serves it at the cost of the instance).
    """
    n = inst.size
    computed, sent = np.empty(n), np.empty(n)
    for k in np.lexsort((arrival, inst)):
        i = int(inst[k])
        held = pool.resident[i]
        need = min(float(tokens[k]), capacity_tokens)
        t = max(float(arrival[k]), pool.admit[i])
        while held and held[0][0] <= t:
            pool.used[i] -= held.popleft()[1]
        while held and pool.used[i] + need > capacity_tokens:
            release, size = held.popleft()
            pool.used[i] -= size
            t = max(t, release)
        start = max(pool.busy[i], t + float(load_s[k]))
        computed[k] = pool.busy[i] = start + float(busy_s[k])
        sent[k] = pool.link[i] = max(pool.link[i], computed[k]) + float(send_s[k])
        held.append((sent[k], need))
        pool.used[i] += need
        pool.admit[i] = t
    return PrefillTimes(computed, sent)


def spread(n: int, load: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Assign ``n`` jobs to eligible servers, least loaded first, round robin (-1 if none)."""
    idx = np.flatnonzero(eligible)
    if idx.size == 0 or n == 0:
        return np.full(n, -1, dtype=np.int64)
    ranked = idx[np.argsort(load[idx], kind="stable")]
    return ranked[np.arange(n) % ranked.size]


def _at(index: np.ndarray, values: np.ndarray, size: int | None = None) -> np.ndarray:
    """``values`` placed at ``index`` in a zero array (of the index's top + 1 by default)."""
    out = np.zeros(int(index.max()) + 1 if size is None else size)
    out[index] = values
    return out


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
        self.admit = np.zeros(cap)  # last admission (FIFO) per instance
        self.used = np.zeros(cap)  # resident KV tokens of in-flight prefills
        self.resident: list[deque[tuple[float, float]]] = [deque() for _ in range(cap)]

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
            self.admit[free] = now + start_s
            self.used[free] = 0.0
            for i in free:
                self.resident[i].clear()
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
        self.key = np.zeros(cap, dtype=np.int64)  # the session's id (a slot is reused)
        self.keys = 0  # ids handed out

    def alloc(self, k: int) -> np.ndarray:
        """Slots for ``k`` new sessions, each with a new id: reuse dead, uncached slots, else
        grow."""
        free = np.flatnonzero(~self.live[: self.n] & (self.home[: self.n] < 0))[:k]
        extra = k - free.size
        if extra > 0:
            if self.n + extra > self.live.size:
                self._grow(max(2 * self.live.size, self.n + extra))
            free = np.concatenate([free, np.arange(self.n, self.n + extra)])
            self.n += extra
        self.key[free] = np.arange(self.keys, self.keys + free.size)
        self.keys += free.size
        return free

    def _grow(self, cap: int) -> None:
        names = ("live", "next", "ctx", "cached", "home", "tier", "last", "turns", "first", "key")
        for name in names:
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


class Simulator:
    """One simulation run; see the module doc for the event model."""

    def __init__(
        self,
        cfg: FleetConfig,
        workload: SessionWorkload | None = None,
        trace: Trace | None = None,
        policy: Policy | None = None,
        sessions: SessionTraffic | None = None,
    ) -> None:
        if sum(x is not None for x in (workload, trace, sessions)) != 1:
            raise ValueError("give exactly one of workload, trace or sessions")
        if isinstance(cfg.routing, ManualRouting) and sessions is None:
            raise ValueError("manual routing needs real sessions (two cached copies per session)")
        if isinstance(cfg.routing, ConsistentHashRouting) and trace is not None:
            raise ValueError("keyed routing needs sessions (a trace's requests carry no key)")
        self.cfg, self.wl, self.trace, self.policy = cfg, workload, trace, policy
        self.traffic = sessions
        self.caches = [InstanceCache(GHOST_BLOCKS) for _ in range(cfg.max_prefill)]
        self._ring: tuple[tuple[int, ...], list[tuple[int, int]]] = ((), [])  # ready set, ring
        self._manual: dict[int, dict[str, int]] = {}  # per router pod: session key -> instance
        self.route_rng = np.random.default_rng(cfg.seed + 7919)  # routing draws only
        self.rng = np.random.default_rng(cfg.seed)
        self.P = _Pool(cfg.n_prefill, cfg.max_prefill)
        self.D = _Pool(cfg.n_decode, cfg.max_decode)
        self.S = _Sessions(1024)
        self.wait = _Requests()
        self.act = _Requests()
        self.decode_turn = 0  # the routers' round-robin counter over ready decode instances
        self.rec = _Records(1 << 16)
        self.done_t = np.empty(0)
        n_steps = math.ceil(cfg.duration_s / cfg.dt)
        self.n_steps = n_steps
        self.bins = {
            k: np.zeros(n_steps + 1)
            for k in (
                "arr", "inp", "cached", "first", "pause", "pauses", "shed",
                "first_seen", "tracked", "tracked_tokens", "tracked_squares", "returning",
            )
        }  # fmt: skip
        self.reuse_bins = np.zeros((n_steps + 1, len(REUSE_BUCKETS_S) + 1))
        self.done_time: list[np.ndarray] = []
        self.series: list[dict[str, float]] = []
        self.tick_reuse: list[ReuseProfile | None] = []
        self.actions = 0
        self.gpu_s = 0.0
        self.peak = 0
        self.retractions = 0
        self.trace_pos = 0
        self.conv_sid: dict[int, int] = {}
        self.shared = workload.mix.shared_prefix_tokens if workload else 0.0
        self.limit: Limit | None = None
        self.tokens = 0.0
        self.shed = 0

    # ------------------------------------------------------------ arrivals

    def _prepopulate(self) -> None:
        """Start in steady state: the sessions live at a random moment of the session process.
        Sessions are drawn as they will run (`workload.draw_turns`, at the modifiers' values at
        0); each of their turns is equally likely to be the one a live session is at (a longer
        session is live longer), so live sessions are turns drawn at random, as many as Little's
        law says (session starts x turns per session x cycle). Each has its turns still to go,
        its next turn a uniform share of a length-biased pause away, and its last prefix cached
        (on a random instance; caches start cold beyond)."""
        wl, S, rng = self.wl, self.S, self.rng
        assert wl is not None
        mix = wl.mix
        cycle = wl.value("tool_pause_s", 0.0) + 8.0
        drawn = draw_turns(
            mix,
            PREPOPULATE_DRAWS,
            rng,
            wl.value("output_tokens", 0.0),
            wl.value("new_tokens_per_turn", 0.0),
        )
        per_session = drawn.context.size / PREPOPULATE_DRAWS
        k = int(rng.poisson(wl.value("session_rate", 0.0) * per_session * cycle))
        if k == 0:
            return
        pick = rng.integers(0, drawn.context.size, k)
        done = drawn.index[pick]
        sid = S.alloc(k)
        per_turn = wl.value("new_tokens_per_turn", 0.0) + wl.value("output_tokens", 0.0)
        S.live[sid] = True
        S.first[sid] = done == 0
        S.ctx[sid] = drawn.context[pick]
        S.turns[sid] = drawn.turns[pick] - done
        # the pause a live session is in is length-biased (a long pause holds a session live
        # for long), and its next turn a uniform share of it away: a lognormal's length-biased
        # draw has the same sigma and e^(sigma^2) times the mean
        pause, sigma = wl.value("tool_pause_s", 0.0), mix.tool_pause_sigma
        biased = lognormal(rng, pause * math.exp(sigma * sigma), sigma, k) + (cycle - pause)
        S.next[sid] = rng.uniform(0.0, 1.0, k) * biased
        # warm caches: each session homed on a ready prefill instance holding its last prefix
        # (at random, or where a keyed router sends it)
        ready = np.flatnonzero(self.P.state == READY)
        homes = ready[rng.integers(0, ready.size, k)]
        if isinstance(self.cfg.routing, ConsistentHashRouting):
            homes = self._ring_owners(self.cfg.routing, S.key[sid], ready)
        S.home[sid] = np.where(done > 0, homes, -1)
        S.tier[sid] = np.where(done > 0, 1, 0)
        S.cached[sid] = np.where(done > 0, np.maximum(S.ctx[sid] - per_turn, 0.0), 0.0)
        S.last[sid] = S.next[sid] - biased
        self._evict()

    def _session_arrivals(self, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray]:
        wl, S = self.wl, self.S
        assert wl is not None
        k = int(self.rng.poisson(wl.value("session_rate", t0) * (t1 - t0)))
        if k:
            sid = self.S.alloc(k)
            mix = wl.mix
            S.live[sid] = True
            S.first[sid] = True
            S.next[sid] = t0 + self.rng.uniform(0.0, t1 - t0, k)
            S.ctx[sid] = np.minimum(
                lognormal(self.rng, mix.first_input_tokens, mix.first_input_sigma, k),
                mix.max_context,
            )
            S.turns[sid] = self.rng.geometric(1.0 / max(mix.mean_turns, 1.0), k)
            S.home[sid], S.tier[sid], S.cached[sid] = -1, 0, 0.0
        due = np.flatnonzero(S.next[: S.n] < t1)
        return due, S.next[due].copy()

    def _trace_arrivals(self, t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tr = self.trace
        assert tr is not None
        lo = self.trace_pos
        hi = int(np.searchsorted(tr.arrival, t1, side="left"))
        self.trace_pos = hi
        sids = np.empty(hi - lo, dtype=np.int64)
        for i, c in enumerate(tr.conversation[lo:hi].tolist()):
            sid = self.conv_sid.get(c)
            if sid is None:
                sid = int(self.S.alloc(1)[0])
                self.conv_sid[c] = sid
                self.S.home[sid], self.S.tier[sid], self.S.cached[sid] = -1, 0, 0.0
                self.S.live[sid] = True  # never recycled: the trace may come back to it
            sids[i] = sid
        S = self.S
        S.ctx[sids] = tr.input_tokens[lo:hi]
        # per-request copies: one conversation may send several requests in one step
        self._trace_inp = tr.input_tokens[lo:hi].copy()
        self._trace_cached = np.minimum(S.cached[sids], tr.cached_prefix[lo:hi])
        S.first[sids] = tr.cached_prefix[lo:hi] <= 0
        S.cached[sids] = np.minimum(S.cached[sids], tr.cached_prefix[lo:hi])
        self._trace_out = tr.output_tokens[lo:hi]
        return sids, tr.arrival[lo:hi].copy(), np.arange(lo, hi)

    # ------------------------------------------------------------ prefill

    def _admit_arrivals(self, step: int, t0: float, t1: float) -> None:
        cfg, S, P = self.cfg, self.S, self.P
        if self.traffic is not None:
            self._admit_sessions(step, t0, t1)
            return
        if self.trace is not None:
            sid, ta, _ = self._trace_arrivals(t1)
            out = self._trace_out
        else:
            sid, ta = self._session_arrivals(t0, t1)
            mean_out = self.wl.value("output_tokens", t0) if self.wl else 1.0
            out = np.maximum(
                1.0,
                np.round(
                    lognormal(
                        self.rng, mean_out, self.wl.mix.output_sigma if self.wl else 0.0, sid.size
                    )
                ),
            )
        if sid.size == 0:
            return
        if self.limit is not None and self.trace is None:
            keep, shed = self._admitted(step, ta, t0, t1)
            if shed.size:
                S.next[sid[shed]] = ta[shed] + RETRY_AFTER_S
            sid, ta, out = sid[keep], ta[keep], out[keep]
            if sid.size == 0:
                return
        ready_p = P.state == READY
        if not ready_p.any():
            S.next[sid] = t1  # nothing can take it: retry next step
            return
        inp = self._trace_inp if self.trace is not None else S.ctx[sid].copy()
        prev = self._trace_cached if self.trace is not None else S.cached[sid]
        home = S.home[sid]
        safe_home = np.where(home >= 0, home, 0)
        prof = cfg.prefill
        shared = np.maximum(np.minimum(self.shared, inp - 1.0), 0.0)
        warm = np.maximum(np.minimum(prev, inp - 1.0), 0.0)
        held = (~S.first[sid]) & (home >= 0) & (S.tier[sid] > 0) & ready_p[safe_home]
        inst, hit = self._route_sessions(held, home, warm, inp, t0, ready_p, S.key[sid])
        cached = np.where(hit, warm, shared)
        host = np.where(hit & (S.tier[sid] == 2), cached, 0.0)
        load = prof.host_load_s_per_token * host
        busy = prof.prefill_time_array(inp - cached, cached)
        flow = min(prof.flow_bytes_per_s, cfg.decode.flow_bytes_per_s)
        xfer = inp * prof.kv_bytes_per_token / flow
        ready = kv_bounded_prefill(inst, ta, load, busy, xfer, inp, prof.kv_capacity_tokens, P).sent
        b = self.bins
        b["arr"][step] += sid.size
        b["inp"][step] += inp.sum()
        b["cached"][step] += cached.sum()
        b["first"][step] += S.first[sid].sum()
        S.home[sid], S.tier[sid], S.last[sid], S.cached[sid] = inst, 1, ta, inp
        S.next[sid] = np.inf
        S.first[sid] = False
        n = sid.size
        self.wait.put(
            {
                "sid": sid,
                "arr": ta,
                "ready": ready,
                "inp": inp,
                "inp0": inp,
                "cached": cached,
                "out": out,
                "gen": np.zeros(n),
                "first": np.full(n, np.nan),
                "inst": np.full(n, -1, dtype=np.int64),
                "tried": np.zeros(n, dtype=bool),
            }
        )

    def _route_sessions(
        self,
        held: np.ndarray,
        home: np.ndarray,
        warm: np.ndarray,
        inp: np.ndarray,
        now: float,
        ready_p: np.ndarray,
        keys: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(instance, hit) per arrival, as the router places them over the session-level
        caches. `CacheAwareRouting`: home when the prefix it holds (``held``, ``warm`` tokens)
        covers more than the threshold of the prompt, else the instance holding the fewest
        cached tokens, one arrival after the other; all to the least loaded while the
        in-prefill loads are imbalanced. `ConsistentHashRouting`: the ring's owner of the
        session's id (``keys``), a hit when that is where its prefix is cached."""
        rt, S, P = self.cfg.routing, self.S, self.P
        ready = np.flatnonzero(ready_p)
        if isinstance(rt, ConsistentHashRouting):
            inst = self._ring_owners(rt, keys, ready)
            return inst, held & (inst == home)
        assert isinstance(rt, CacheAwareRouting)  # (`__init__`: manual needs real sessions)
        loads = np.array([self._in_prefill(i, now) for i in ready.tolist()], dtype=float)
        if loads.max() - loads.min() > rt.balance_abs_threshold and loads.max() > (
            rt.balance_rel_threshold * loads.min()
        ):
            inst = spread(home.size, _at(ready, loads, P.state.size), ready_p)
            return inst, held & (inst == home)
        hit = held & (warm > rt.cache_threshold * inp)
        inst = np.where(hit, home, -1)
        cached = S.home[: S.n] >= 0
        tree = np.bincount(
            S.home[: S.n][cached],
            weights=np.where(S.tier[: S.n][cached] > 0, S.cached[: S.n][cached], 0.0),
            minlength=P.state.size,
        ).astype(float)
        tree += np.bincount(home[hit], weights=inp[hit], minlength=P.state.size)
        for k in np.flatnonzero(~hit).tolist():
            i = int(ready[int(np.argmin(tree[ready]))])
            inst[k] = i
            tree[i] += inp[k]
        return inst, hit

    def _admitted(
        self, step: int, ta: np.ndarray, t0: float, t1: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(admitted, refused) indices of the arrivals at ``ta``: the bucket admits in time
        order; the caller sends the refused again ``RETRY_AFTER_S`` later (a 429)."""
        limit = self.limit
        assert limit is not None
        self.tokens = min(limit.bucket, self.tokens + limit.rate * (t1 - t0))
        room = limit.in_flight - (len(self.wait) + len(self.act))  # inf without smg's bound
        k = max(0, int(min(ta.size, self.tokens, room)))
        order = np.argsort(ta, kind="stable")
        keep, shed = np.sort(order[:k]), order[k:]
        self.tokens -= k
        if shed.size:
            self.shed += int(shed.size)
            self.bins["shed"][step] += shed.size
        return keep, shed

    # ------------------------------------------------------------ real sessions

    def _admit_sessions(self, step: int, t0: float, t1: float) -> None:
        """Real sessions' requests released in this step: admission, the product's
        cache-aware routing over the instances' block-exact caches, then prefill."""
        traffic, cfg, P = self.traffic, self.cfg, self.P
        assert traffic is not None
        due = traffic.due(t1)
        if due.chain.size == 0:
            return
        chain, ta, place, req = due.chain, due.time, due.placement, due.request
        if self.limit is not None:
            keep, shed = self._admitted(step, ta, t0, t1)
            traffic.retry(chain[shed], ta[shed] + RETRY_AFTER_S)
            chain, ta, place, req = chain[keep], ta[keep], place[keep], req[keep]
            if chain.size == 0:
                return
        ready = np.flatnonzero(P.state == READY)
        if ready.size == 0:
            traffic.retry(chain, np.full(chain.size, t1))
            return
        n = chain.size
        inp, out = np.empty(n), np.empty(n)
        cached, host, inst = np.zeros(n), np.zeros(n), np.empty(n, dtype=np.int64)
        first = np.zeros(n, dtype=bool)
        routed = np.zeros(P.state.size)
        for k in range(n):
            s = traffic.session(int(place[k]))
            r = int(req[k])
            inp[k], out[k] = float(s.input_tokens[r]), float(s.output_tokens[r])
            first[k] = r in s.first[:-1]
            i, gpu, hit = self._route(
                step, traffic.scope(int(place[k])), s.trie, int(s.leaf[r]), int(s.blocks[r]),
                inp[k], float(ta[k]), ready, routed,
            )  # fmt: skip
            inst[k], cached[k], host[k] = i, hit, hit - gpu
            routed[i] += 1
        prof = cfg.prefill
        load = prof.host_load_s_per_token * host
        busy = prof.prefill_time_array(inp - cached, cached)
        flow = min(prof.flow_bytes_per_s, cfg.decode.flow_bytes_per_s)
        xfer = inp * prof.kv_bytes_per_token / flow
        sent = kv_bounded_prefill(inst, ta, load, busy, xfer, inp, prof.kv_capacity_tokens, P).sent
        b = self.bins
        b["arr"][step] += n
        b["inp"][step] += inp.sum()
        b["cached"][step] += cached.sum()
        b["first"][step] += first.sum()
        self.wait.put(
            {
                "sid": chain,
                "arr": ta,
                "ready": sent,
                "inp": inp,
                "inp0": inp,
                "cached": cached,
                "out": out,
                "gen": np.zeros(n),
                "first": np.full(n, np.nan),
                "inst": np.full(n, -1, dtype=np.int64),
                "tried": np.zeros(n, dtype=bool),
            }
        )

    def _route(
        self,
        step: int,
        scope: str,
        trie: BlockTrie,
        leaf: int,
        blocks: int,
        inp: float,
        now: float,
        ready: np.ndarray,
        routed: np.ndarray,
    ) -> tuple[int, float, float]:
        """The instance the router picks (``FleetConfig.routing``) and the request's cached
        tokens there (GPU tier, any tier); the instance's cache and its engine's reuse
        measurement take the request."""
        rt, prof, caches = self.cfg.routing, self.cfg.prefill, self.caches
        gpu_blocks = int(prof.kv_capacity_tokens // BLOCK_SIZE)
        any_blocks = int((prof.kv_capacity_tokens + prof.host_cache_tokens) // BLOCK_SIZE)
        found: dict[int, list[Overlap]] = {}
        if isinstance(rt, ConsistentHashRouting):  # keyed: only the chosen cache is read
            choice = self._ring_owner(rt, scope, ready)
        elif isinstance(rt, ManualRouting):
            choice = self._manual_owner(rt, scope, ready)
        else:
            best, best_blocks = -1, 0
            for i in ready.tolist():
                if caches[i].holds(scope):
                    found[i] = caches[i].lookup(scope, trie, leaf)
                    m = sum(ov.within(any_blocks) for ov in found[i])
                    if m > best_blocks:
                        best, best_blocks = i, m
            cover = best_blocks * BLOCK_SIZE > rt.cache_threshold * inp
            choice = self._cache_aware_choice(
                rt, best if cover else -1, any_blocks, now, ready, routed
            )
        if choice not in found and caches[choice].holds(scope):
            found[choice] = caches[choice].lookup(scope, trie, leaf)
        ovs = found.get(choice, [])
        gpu = sum(ov.within(gpu_blocks) for ov in ovs) * BLOCK_SIZE
        hit = sum(ov.within(any_blocks) for ov in ovs) * BLOCK_SIZE
        self._measure_reuse(step, ovs, blocks, inp, now)
        caches[choice].reference(scope, trie, leaf, blocks, now, ovs)
        cap = max(inp - 1.0, 0.0)  # the last token is always computed
        return choice, min(gpu, cap), min(hit, cap)

    def _cache_aware_choice(
        self,
        rt: CacheAwareRouting,
        best: int,
        any_blocks: int,
        now: float,
        ready: np.ndarray,
        routed: np.ndarray,
    ) -> int:
        """`CacheAwareRouting`'s pick: the least loaded while the loads are imbalanced, else
        the instance holding the longest prefix over the threshold (``best``, -1: none), else
        the one caching the least (its tree capped at ``any_blocks``)."""
        caches = self.caches
        loads = np.array([self._in_prefill(i, now) + routed[i] for i in ready.tolist()])
        lo, hi = float(loads.min()), float(loads.max())
        if hi - lo > rt.balance_abs_threshold and hi > rt.balance_rel_threshold * lo:
            return int(ready[int(np.argmin(loads))])
        if best >= 0:
            return best
        trees = np.array([min(caches[i].total, any_blocks) for i in ready.tolist()])
        return int(ready[np.lexsort((loads, trees))[0]])

    def _ring_owner(self, rt: ConsistentHashRouting, key: str, ready: np.ndarray) -> int:
        """The first ready instance clockwise of ``key`` on the hash ring
        (`ConsistentHashRouting`); the ring of a set of ready instances is built once."""
        members = tuple(ready.tolist())
        if self._ring[0] != members:  # the ready set changes rarely: the latest one's ring
            self._ring = (members, sorted(pt for i in members for pt in rt.points(i)))
        ring = self._ring[1]
        k = bisect.bisect_left(ring, (_ring_hash(key), -1))
        return ring[k % len(ring)][1]

    def _ring_owners(
        self, rt: ConsistentHashRouting, keys: np.ndarray, ready: np.ndarray
    ) -> np.ndarray:
        """`_ring_owner` of synthetic sessions by their ids (`_Sessions.key`)."""
        owners = [self._ring_owner(rt, f"s{k}", ready) for k in keys.tolist()]
        return np.array(owners, dtype=np.int64)

    def _manual_owner(self, rt: ManualRouting, key: str, ready: np.ndarray) -> int:
        """`ManualRouting`'s pick: the instance the router pod taking this request keeps for
        ``key``, a random ready one when it has none or that one is not ready."""
        pod = int(self.route_rng.integers(rt.replicas))
        owners = self._manual.setdefault(pod, {})
        i = owners.get(key)
        if i is None or self.P.state[i] != READY:
            i = owners[key] = int(ready[int(self.route_rng.integers(ready.size))])
        return i

    def _in_prefill(self, i: int, now: float) -> int:
        """Requests on prefill instance ``i`` whose KV has not been sent yet."""
        return sum(1 for sent, _ in self.P.resident[i] if sent > now)

    def _measure_reuse(
        self, step: int, overlaps: list[Overlap], blocks: int, inp: float, now: float
    ) -> None:
        """What the chosen instance's engine exports for this request
        (`cas_engine.prefixreuse`, exact: every block tracked): tokens by the time since
        their block was last referenced on the instance, tokens seen for the first time,
        the request and its full-block tokens, and its prompt when it reused a block."""
        b, seen = self.bins, 0
        for ov in overlaps:
            bucket = bisect.bisect_left(REUSE_BUCKETS_S, now - ov.time)
            self.reuse_bins[step, bucket] += ov.blocks * BLOCK_SIZE
            seen += ov.blocks
        tokens = blocks * BLOCK_SIZE
        b["first_seen"][step] += (blocks - seen) * BLOCK_SIZE
        b["tracked"][step] += 1
        b["tracked_tokens"][step] += tokens
        b["tracked_squares"][step] += float(tokens) ** 2
        if seen:
            b["returning"][step] += inp

    # ------------------------------------------------------------ decode

    def _step_times(self) -> tuple[np.ndarray, np.ndarray]:
        """Per decode instance: (step seconds, KV tokens used)."""
        prof, D, A = self.cfg.decode, self.D, self.act
        cap = D.state.size
        batch = np.bincount(A["inst"], minlength=cap).astype(np.float64)
        used = np.bincount(A["inst"], weights=A["inp"] + A["gen"], minlength=cap)
        step = (
            prof.decode_step_base_s
            + prof.decode_step_per_seq_s * batch
            + prof.decode_step_per_ctx_token_s * used
        )
        return step, used

    def _admit_decode(self, t0: float, t1: float) -> None:
        W, D, prof = self.wait, self.D, self.cfg.decode
        cand = W["ready"] < t1
        if not cand.any():
            return
        step, used = self._step_times()
        ready_d = D.state == READY
        free = np.where(ready_d, prof.kv_capacity_tokens - used, -np.inf)
        rows = W.take(cand)
        order = np.argsort(rows["ready"], kind="stable")
        rows = {k: v[order] for k, v in rows.items()}
        n = rows["sid"].size
        if decodes_in_turn(self.cfg.routing):
            inst = self._decode_in_turn(rows["inst"], ready_d)
        else:
            inst = spread(n, -free, ready_d)
        if inst.size and inst[0] < 0:
            rows["tried"][:] = True
            W.put(rows)
            return
        o = np.lexsort((rows["ready"], inst))
        g = inst[o]
        need = rows["inp"][o] + rows["gen"][o]
        csum = np.cumsum(need)
        first = np.ones(n, dtype=bool)
        first[1:] = g[1:] != g[:-1]
        seg_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        within = csum - (csum[seg_start] - need[seg_start])
        ok_sorted = within <= free[g]
        ok = np.empty(n, dtype=bool)
        ok[o] = ok_sorted
        rows["inst"] = inst
        start = np.where(rows["tried"], t0, np.maximum(rows["ready"], t0))
        new_first = start + step[inst] / 1.0
        fresh = np.isnan(rows["first"])
        rows["first"] = np.where(ok & fresh, new_first, rows["first"])
        rows["gen"] = np.where(ok & fresh, 1.0, rows["gen"])
        rows["ready"] = np.where(ok, start, rows["ready"])
        admitted = {k: v[ok] for k, v in rows.items()}
        waiting = {k: v[~ok] for k, v in rows.items()}
        waiting["tried"] = np.ones(int((~ok).sum()), dtype=bool)
        self.act.put(admitted)
        W.put(waiting)

    def _decode_in_turn(self, placed: np.ndarray, ready_d: np.ndarray) -> np.ndarray:
        """Each waiting request's decode instance: the one it was given while that one is
        ready, else the next ready one in turn (round robin, in the order given); -1 for
        all when none is ready."""
        ready = np.flatnonzero(ready_d)
        if ready.size == 0:
            return np.full(placed.size, -1, dtype=np.int64)
        inst = placed.copy()
        unplaced = (inst < 0) | ~ready_d[np.maximum(inst, 0)]
        k = int(unplaced.sum())
        inst[unplaced] = ready[(self.decode_turn + np.arange(k)) % ready.size]
        self.decode_turn += k
        return inst

    def _progress_decode(self, step_idx: int, t0: float, t1: float) -> None:
        A, prof = self.act, self.cfg.decode
        if len(A) == 0:
            return
        step, _used = self._step_times()
        acc = prof.accept_length * self.cfg.accept_multiplier
        rate = acc / step[A["inst"]]
        begin = np.maximum(t0, np.maximum(A["first"], A["ready"]))
        A["gen"] = A["gen"] + rate * np.maximum(t1 - begin, 0.0)
        self._retract(t1)
        fin = A["gen"] >= A["out"]
        if fin.any():
            rows = A.take(fin)
            r = acc / step[rows["inst"]]
            t_end = t1 - (rows["gen"] - rows["out"]) / r
            t_end = np.maximum(t_end, rows["first"])
            itl = (t_end - rows["first"]) / np.maximum(rows["out"] - 1.0, 1.0)
            self._finish(step_idx, rows, t_end, itl)

    def _retract(self, now: float) -> None:
        """Requests that no longer fit (context growth) go back to wait, newest first."""
        A, cap = self.act, self.cfg.decode.kv_capacity_tokens
        use = A["inp"] + A["gen"]
        tot = np.bincount(A["inst"], weights=use, minlength=self.D.state.size)
        if not (tot > cap).any():
            return
        o = np.lexsort((A["first"], A["inst"]))
        g = A["inst"][o]
        csum = np.cumsum(use[o])
        n = g.size
        first = np.ones(n, dtype=bool)
        first[1:] = g[1:] != g[:-1]
        seg_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        within = csum - (csum[seg_start] - use[o][seg_start])
        out_sorted = within > cap
        out = np.empty(n, dtype=bool)
        out[o] = out_sorted
        rows = A.take(out)
        self.retractions += int(out.sum())
        rows["inp"] = rows["inp"] + rows["gen"]
        rows["out"] = rows["out"] - rows["gen"]
        rows["gen"] = np.zeros(rows["sid"].size)
        rows["ready"] = np.full(rows["sid"].size, now)
        rows["tried"] = np.ones(rows["sid"].size, dtype=bool)
        self.wait.put(rows)

    def _finish(
        self, step_idx: int, rows: dict[str, np.ndarray], t_end: np.ndarray, itl: np.ndarray
    ) -> None:
        total_out = rows["out"] + (rows["inp"] - rows["inp0"])
        self.rec.add(
            arrival=rows["arr"],
            ttft=rows["first"] - rows["arr"],
            itl=itl,
            input=rows["inp0"],
            cached=rows["cached"],
            output=total_out,
        )
        self.done_time.append(t_end)
        if self.limit is not None and self.limit.returns:  # sglang-router 0.3.2's bucket
            self.tokens = min(self.limit.bucket, self.tokens + float(t_end.size))
        if self.traffic is not None:
            self._session_turns(step_idx, rows["sid"], t_end)
            return
        if self.trace is not None or self.wl is None:
            return
        S, mix, sid = self.S, self.wl.mix, rows["sid"]
        t = float(t_end.min()) if t_end.size else 0.0
        grow = lognormal(
            self.rng, self.wl.value("new_tokens_per_turn", t), mix.new_tokens_sigma, sid.size
        )
        pause = lognormal(
            self.rng, self.wl.value("tool_pause_s", t), mix.tool_pause_sigma, sid.size
        )
        self.bins["pause"][step_idx] += pause.sum()
        self.bins["pauses"][step_idx] += pause.size
        S.turns[sid] -= 1
        S.ctx[sid] = rows["inp0"] + total_out + grow
        ends = (S.turns[sid] <= 0) | (S.ctx[sid] > mix.max_context)
        S.next[sid] = np.where(ends, np.inf, t_end + pause)
        S.live[sid[ends]] = False

    def _session_turns(self, step_idx: int, chains: np.ndarray, t_end: np.ndarray) -> None:
        """Real sessions: the answered chains release their next requests after their think
        times (counted as the window's tool pauses)."""
        traffic = self.traffic
        assert traffic is not None
        thinks = traffic.finished(chains, t_end)
        self.bins["pause"][step_idx] += sum(thinks)
        self.bins["pauses"][step_idx] += len(thinks)

    def _warm_sessions(self) -> None:
        """Sessions already running at the start: their last request before it is routed and
        cached at its trace time, in time order (no load yet, nothing measured)."""
        traffic = self.traffic
        assert traffic is not None
        ready = np.flatnonzero(self.P.state == READY)
        if ready.size == 0:
            return
        saved = (self.reuse_bins.copy(), {k: v.copy() for k, v in self.bins.items()})
        none = np.zeros(self.P.state.size)
        for w in traffic.warm:
            s = traffic.session(w.placement)
            r = w.request
            self._route(
                0, traffic.scope(w.placement), s.trie, int(s.leaf[r]), int(s.blocks[r]),
                float(s.input_tokens[r]), w.time, ready, none,
            )  # fmt: skip
        self.reuse_bins, self.bins = saved

    # ------------------------------------------------------------ caches

    def _evict(self) -> None:
        """Per prefill instance LRU over sessions: GPU tier, then host tier, then gone."""
        S, prof, P = self.S, self.cfg.prefill, self.P
        idx = np.flatnonzero(S.home[: S.n] >= 0)
        if idx.size == 0:
            return
        home = S.home[idx]
        dead = P.state[home] == OFF
        S.home[idx[dead]], S.tier[idx[dead]] = -1, 0
        idx, home = idx[~dead], home[~dead]
        o = np.lexsort((-S.last[idx], home))
        idx, g = idx[o], home[o]
        size = S.cached[idx]
        csum = np.cumsum(size)
        n = g.size
        if n == 0:
            return
        first = np.ones(n, dtype=bool)
        first[1:] = g[1:] != g[:-1]
        seg_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        within = csum - (csum[seg_start] - size[seg_start])
        tier = np.where(
            within <= prof.kv_capacity_tokens,
            1,
            np.where(within <= prof.kv_capacity_tokens + prof.host_cache_tokens, 2, 0),
        )
        S.tier[idx] = tier
        gone = idx[tier == 0]
        S.home[gone] = -1

    # ------------------------------------------------------------ control

    def _on_removed(self, p_gone: np.ndarray, d_gone: np.ndarray, now: float) -> None:
        for i in p_gone.tolist():  # a removed pod's cache and ghost map are gone
            self.caches[i] = InstanceCache(GHOST_BLOCKS)
        if p_gone.size:
            lost = np.isin(self.S.home[: self.S.n], p_gone)
            self.S.home[: self.S.n][lost] = -1
            self.S.tier[: self.S.n][lost] = 0
        if d_gone.size and len(self.act):
            moved = np.isin(self.act["inst"], d_gone)
            if moved.any():
                rows = self.act.take(moved)
                rows["ready"] = np.full(rows["sid"].size, now)
                rows["tried"] = np.ones(rows["sid"].size, dtype=bool)
                self.retractions += rows["sid"].size
                self.wait.put(rows)

    def metrics(self, step: int, now: float) -> Metrics:
        """Window aggregates ending ``metric_lag_s`` before ``now``."""
        cfg, b = self.cfg, self.bins
        hi = max(0, step - int(cfg.metric_lag_s / cfg.dt))
        lo, span = self._window(hi, cfg.metric_window_s)
        recent_lo, recent_span = self._window(hi, rate_window(cfg.metric_window_s))
        arr = b["arr"][lo:hi].sum()
        inp = b["inp"][lo:hi].sum()
        t_hi, t_lo = hi * cfg.dt, lo * cfg.dt
        done = np.concatenate(self.done_time) if self.done_time else np.empty(0)
        self.done_time = [done]
        sel = (done >= t_lo) & (done < t_hi)
        ttft = self.rec.view("ttft")[sel] if done.size == self.rec.n else np.empty(0)
        itl = self.rec.view("itl")[sel] if done.size == self.rec.n else np.empty(0)
        inputs = self.rec.view("input")[sel] if done.size == self.rec.n else np.empty(0)
        outs = self.rec.view("output")[sel] if done.size == self.rec.n else np.empty(0)
        ready_p = self.P.state == READY
        backlog = np.maximum(self.P.busy[ready_p] - now, 0.0)
        _, used = self._step_times()
        ready_d = self.D.state == READY
        cap = max(ready_d.sum() * cfg.decode.kv_capacity_tokens, 1.0)
        pauses = b["pauses"][lo:hi].sum()
        return Metrics(
            arrival_rate=arr / span,
            hit_rate=float(b["cached"][lo:hi].sum() / inp) if inp else 0.0,
            ttft_p90_s=float(np.quantile(ttft, 0.9)) if ttft.size else 0.0,
            itl_ms=float(np.mean(itl) * 1000.0) if itl.size else 0.0,
            avg_input_tokens=float(inp / arr) if arr else 0.0,
            p95_input_tokens=float(np.quantile(inputs, 0.95)) if inputs.size else 0.0,
            avg_output_tokens=float(outs.mean()) if outs.size else 0.0,
            first_turn_fraction=float(b["first"][lo:hi].sum() / arr) if arr else 0.0,
            tool_pause_s=float(b["pause"][lo:hi].sum() / pauses) if pauses else 0.0,
            prefill_backlog_s=float(backlog.mean()) if backlog.size else 0.0,
            decode_kv_usage=float(used[ready_d].sum() / cap),
            decode_waiting=int((self.wait["ready"] <= now).sum()),
            refused_rate=float(b["shed"][lo:hi].sum() / span),
            reuse=self._reuse(lo, hi) if self.traffic is not None else None,
            recent_arrival_rate=float(b["arr"][recent_lo:hi].sum() / recent_span),
        )

    def _window(self, hi: int, seconds: float) -> tuple[int, float]:
        """The first step of the ``seconds`` ending before step ``hi``, and their length."""
        dt = self.cfg.dt
        lo = max(0, hi - int(seconds / dt))
        return lo, max((hi - lo) * dt, dt)

    def _reuse(self, lo: int, hi: int) -> ReuseProfile | None:
        """The window's prompt reuse over every prefill instance, as the operator sums the
        engines' counters (`autoscale.signals.prompt_reuse`)."""
        b = self.bins
        per_bucket = self.reuse_bins[lo:hi].sum(axis=0)
        bounds = [*REUSE_BUCKETS_S, math.inf]
        return profile_from_counts(
            list(zip(bounds, np.cumsum(per_bucket).tolist(), strict=True)),
            first_seen_tokens=float(b["first_seen"][lo:hi].sum()),
            requests=float(b["tracked"][lo:hi].sum()),
            request_tokens=float(b["tracked_tokens"][lo:hi].sum()),
            request_token_squares=float(b["tracked_squares"][lo:hi].sum()),
            returning_prompt_tokens=float(b["returning"][lo:hi].sum()),
        )

    def _tick(self, step: int, now: float) -> None:
        cfg = self.cfg
        view = FleetView(
            self.P.spec(),
            self.D.spec(),
            self.P.pods(),
            self.D.pods(),
            int((self.P.state == READY).sum()),
            int((self.D.state == READY).sum()),
        )
        m = self.metrics(step, now)
        if self.policy is not None:
            want_p, want_d = self.policy(now, m, view)
            want_p = min(max(want_p, 1), cfg.max_prefill)
            want_d = min(max(want_d, 1), cfg.max_decode)
            pp, pd = cfg.prefill, cfg.decode
            self.actions += self.P.scale(want_p, now, pp.pod_start_s, pp.drain_s) > 0
            self.actions += self.D.scale(want_d, now, pd.pod_start_s, pd.drain_s) > 0
        if cfg.admission is not None:
            ready_p = int((self.P.state == READY).sum())
            ready_d = int((self.D.state == READY).sum())
            self.limit = cfg.admission(ready_p, ready_d)
        self.series.append(
            {
                "t": now,
                "prefill": float(self.P.spec()),
                "decode": float(self.D.spec()),
                "arrival_rate": m.arrival_rate,
                "hit_rate": m.hit_rate,
                "ttft_p90_s": m.ttft_p90_s,
                "itl_ms": m.itl_ms,
                "decode_kv_usage": m.decode_kv_usage,
                "ready_prefill": float((self.P.state == READY).sum()),
                "ready_decode": float((self.D.state == READY).sum()),
                "admit_rate": self.limit.rate if self.limit is not None else math.inf,
                "avg_input_tokens": m.avg_input_tokens,
                "avg_output_tokens": m.avg_output_tokens,
            }
        )
        self.tick_reuse.append(m.reuse)

    # ------------------------------------------------------------ main loop

    def run(self) -> SimResult:
        cfg = self.cfg
        tick_every = max(1, round(cfg.tick_s / cfg.dt))
        evict_every = max(1, round(cfg.evict_every_s / cfg.dt))
        gp, gd = cfg.prefill.gpus, cfg.decode.gpus
        if self.wl is not None and cfg.prepopulate:
            self._prepopulate()
        if self.traffic is not None and cfg.prepopulate:
            self._warm_sessions()
        if cfg.admission is not None:
            self.limit = cfg.admission(cfg.n_prefill, cfg.n_decode)
            self.tokens = self.limit.bucket if self.limit is not None else 0.0
        for step in range(self.n_steps):
            t0 = step * cfg.dt
            t1 = t0 + cfg.dt
            self._on_removed(self.P.advance(t0), self.D.advance(t0), t0)
            if step % tick_every == 0 and step > 0:
                self._tick(step, t0)
            self._admit_arrivals(step, t0, t1)
            self._admit_decode(t0, t1)
            self._progress_decode(step, t0, t1)
            if step % evict_every == 0:
                self._evict()
            held = self.P.pods() * gp + self.D.pods() * gd
            self.gpu_s += held * cfg.dt
            self.peak = max(self.peak, held)
        r = self.rec
        return SimResult(
            arrival=r.view("arrival").copy(),
            ttft=r.view("ttft").copy(),
            itl=r.view("itl").copy(),
            input_tokens=r.view("input").copy(),
            cached_tokens=r.view("cached").copy(),
            output_tokens=r.view("output").copy(),
            series=self.series,
            scale_actions=int(self.actions),
            peak_gpus=self.peak,
            gpu_seconds=self.gpu_s,
            retractions=self.retractions,
            shed=self.shed,
            steps=self.n_steps,
            duration_s=cfg.duration_s,
            warmup_s=cfg.warmup_s,
            reuse=self.tick_reuse,
        )


def simulate(
    cfg: FleetConfig,
    workload: SessionWorkload | None = None,
    trace: Trace | None = None,
    policy: Policy | None = None,
    sessions: SessionTraffic | None = None,
) -> SimResult:
    """Run one simulation (see :class:`Simulator`)."""
    return Simulator(cfg, workload=workload, trace=trace, policy=policy, sessions=sessions).run()
