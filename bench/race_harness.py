"""Race reproduction harness: real KV writes between processes, decode aborts and slot reuse.

Benchmark and test code, not part of the engine: used by ``bench/race.py`` (``make bench-race``)
and ``tests/engine/test_race_repro.py``; it drives the engine's :mod:`cas_engine.kvfence`.

Processes (spawned, loopback only): one decode process and ``prefill_ranks`` prefill processes.
Bytes move through :mod:`cas_engine.kvfence.transport` (mooncake TCP, or shared memory as the
fallback); control messages (request, abort, done, ack) travel on multiprocessing queues.

Decode process (owns the KV pool and the :class:`ReclaimLedger`): open-loop Poisson arrivals;
admits a request into free pages (LIFO, so just-freed pages are reused first, as under pressure);
sends each rank the pages it must write; aborts requests whose prefill misses ``budget_s`` and
frees per the ledger's mode; when every rank reports done, verifies the pages against the
expected content, holds them ``decode_hold_s`` (decoding reads KV all along), verifies again and
finishes. A request is bad if any check fails.

Prefill rank (owns its source pages and a :class:`WriteTracker`): a single-threaded loop.
Requests queue as chunks; a chunk is issued (counted outstanding) when fewer than
``max_inflight`` are in flight, then completes after a seeded delay (exponential queueing plus,
with ``stall_prob``, a Pareto stall) when its bytes are written. Aborts skip queued chunks; the
ack goes out when nothing is outstanding. STRICT keeps source pages pinned until the room's
writes complete; the other modes free them at abort, as upstream does.

Page content is a deterministic function of (room, generation, page index), so every page of
every completed request is checked.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing as mp
import queue
import random
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cas_engine.kvfence.ledger import Reclaim, ReclaimLedger
from cas_engine.kvfence.messages import AbortNotice, ReclaimAck, ReclaimMode
from cas_engine.kvfence.metrics import RECLAIM_OUTCOMES
from cas_engine.kvfence.tracker import WriteTracker
from cas_engine.kvfence.transport import DecodePool, PageWriter, PoolSpec, Transport


@dataclass(frozen=True)
class RaceParams:
    """Knobs of one run. P:D pressure = ``arrival_rate`` vs the prefill write capacity."""

    mode: ReclaimMode = ReclaimMode.STRICT
    transport: Transport = Transport.MOONCAKE
    requests: int = 2000
    arrival_rate: float = 1500.0  # offered requests per second
    prefill_ranks: int = 1
    pages_per_request: int = 4
    chunks_per_request: int = 2  # per rank
    words_per_page: int = 16  # uint64 words (128-byte pages: small, so runs are fast)
    decode_pages: int = 2048
    source_pages: int = 2048  # per rank
    max_inflight: int = 16  # per rank
    budget_s: float = 0.05  # prefill time budget; late requests are aborted
    service_s: float = 0.0003  # mean queueing delay of an issued chunk
    stall_prob: float = 0.004  # per chunk
    stall_s: float = 0.04  # Pareto scale of a stall
    stall_alpha: float = 1.3
    stall_cap_s: float = 1.0
    upstream_timeout_s: float = 0.1  # UPSTREAM's timer, scaled from SGLang's 30 s
    decode_hold_s: float = 0.1  # decoding keeps reading its KV this long
    seed: int = 1
    max_wall_s: float = 600.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mode"] = self.mode.value
        data["transport"] = self.transport.value
        return data


@dataclass
class RaceResult:
    mode: str
    transport: str
    admitted: int = 0
    completed: int = 0
    bad: int = 0
    aborted: int = 0
    wall_s: float = 0.0
    throughput_rps: float = 0.0
    goodput_rps: float = 0.0
    bad_per_10k: float = 0.0
    bad_per_10k_ci95: tuple[float, float] = (0.0, 0.0)
    abort_to_reuse_p50_ms: float = 0.0
    abort_to_reuse_p99_ms: float = 0.0
    ack_to_reuse_p50_ms: float = 0.0  # releasing ack sent -> slots free: the fence's own cost
    ack_to_reuse_p99_ms: float = 0.0
    quarantine_peak_pages: int = 0
    quarantined_at_end: int = 0
    reclaims: dict[str, int] = field(default_factory=dict)
    ignored_messages: dict[str, int] = field(default_factory=dict)
    aborts_per_second: list[int] = field(default_factory=list)  # bursts show CPU starvation
    completions_per_second: list[int] = field(default_factory=list)
    timed_out: bool = False


def expected_pages(room: int, generation: int, indices: list[int], words: int) -> np.ndarray:
    """The content prefill writes for pages ``indices`` of a room: distinct in every word."""
    base = np.array(
        [(room * 1_000_003 + generation * 7_919 + i * 104_729 + 1) << 16 for i in indices],
        dtype=np.uint64,
    )
    return base[:, None] + np.arange(words, dtype=np.uint64)[None, :]


def wilson_interval(bad: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of bad/total, scaled to per 10,000."""
    if total == 0:
        return (0.0, 0.0)
    p = bad / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return (max(0.0, centre - half) * 1e4, min(1.0, centre + half) * 1e4)


def rank_pages(pages: int, ranks: int, rank: int) -> list[int]:
    """Indices (within a request) of the pages that ``rank`` writes."""
    return [i for i in range(pages) if i % ranks == rank]


# ---- prefill rank ------------------------------------------------------------------------------


@dataclass
class _Job:
    room: int
    gen: int
    indices: list[int]
    dst: list[int]
    src: list[int]
    remaining: int
    aborted: bool = False
    src_freed: bool = False


class _PrefillRank:
    """One prefill rank's single-threaded loop (see the module docstring)."""

    def __init__(self, rank: int, params: RaceParams, spec: PoolSpec, outq: Any) -> None:
        self.rank, self.p, self.outq = rank, params, outq
        self.writer = PageWriter(spec, params.source_pages)
        self.tracker = WriteTracker(rank)
        self.rng = random.Random(params.seed * 1000 + rank)
        self.free_src = list(range(params.source_pages))
        self.jobs: dict[tuple[int, int], _Job] = {}
        self.waiting: deque[tuple[int, int, list[int], list[int]]] = deque()
        self.pending: deque[tuple[_Job, list[int]]] = deque()  # queued chunks (page positions)
        self.inflight: list[tuple[float, int, _Job, list[int]]] = []  # heap by due time
        self.seq = 0

    def on_message(self, msg: tuple) -> bool:
        if msg[0] == "req":
            self.waiting.append(msg[1:])
        elif msg[0] == "abort":
            self._abort(AbortNotice.from_dict(msg[1]))
        elif msg[0] == "stop":
            return False
        return True

    def start_waiting(self) -> None:
        """Begin queued requests while source pages are free (prefill queueing)."""
        while self.waiting and len(self.free_src) >= len(self.waiting[0][2]):
            room, gen, indices, dst = self.waiting.popleft()
            if not self.tracker.begin(room, gen):
                continue
            src = [self.free_src.pop() for _ in indices]
            self.writer.source[src] = expected_pages(room, gen, indices, self.p.words_per_page)
            job = _Job(room, gen, indices, dst, src, remaining=0)
            self.jobs[(room, gen)] = job
            positions = list(range(len(indices)))
            n = max(1, min(self.p.chunks_per_request, len(positions)))
            chunks = [positions[i::n] for i in range(n)]
            job.remaining = len(chunks)
            for chunk in chunks:
                self.pending.append((job, chunk))

    def issue(self, now: float) -> None:
        while self.pending and len(self.inflight) < self.p.max_inflight:
            job, chunk = self.pending.popleft()
            ok = self.tracker.try_issue(job.room, job.gen)
            job.remaining -= 1
            if job.remaining == 0:
                self._send_ack(self.tracker.seal(job.room, job.gen))
            if not ok:
                self._settle(job)
                continue
            self.seq += 1
            heapq.heappush(self.inflight, (now + self._delay(), self.seq, job, chunk))

    def complete_due(self, now: float) -> bool:
        if not self.inflight or self.inflight[0][0] > now:
            return False
        _, _, job, chunk = heapq.heappop(self.inflight)
        ok = self.writer.write([job.src[i] for i in chunk], [job.dst[i] for i in chunk])
        self._send_ack(self.tracker.write_done(job.room, job.gen, ok=ok))
        self._settle(job)
        return True

    def next_due(self) -> float | None:
        return self.inflight[0][0] if self.inflight else None

    def _delay(self) -> float:
        delay = self.rng.expovariate(1.0 / self.p.service_s)
        if self.rng.random() < self.p.stall_prob:
            delay += min(
                self.p.stall_cap_s, self.p.stall_s * self.rng.paretovariate(self.p.stall_alpha)
            )
        return delay

    def _abort(self, notice: AbortNotice) -> None:
        job = self.jobs.get((notice.room, notice.generation))
        if job is not None:
            job.aborted = True
        self._send_ack(self.tracker.on_abort(notice))
        if job is not None:
            self._settle(job)

    def _settle(self, job: _Job) -> None:
        """Free source pages (STRICT: only once unpinned) and report a normal completion."""
        key = (job.room, job.gen)
        pinned = self.tracker.is_pinned(job.room, job.gen)
        strict = self.p.mode is ReclaimMode.STRICT
        if not job.src_freed and (not pinned or (job.aborted and not strict)):
            self.free_src.extend(job.src)
            job.src_freed = True
        if pinned:
            return
        if not job.aborted and job.remaining == 0:
            self.outq.put(("done", self.rank, job.room, job.gen))
        if job.src_freed:
            self.jobs.pop(key, None)

    def _send_ack(self, ack: ReclaimAck | None) -> None:
        if ack is not None:
            self.outq.put(("ack", ack.to_dict(), time.monotonic()))


def prefill_main(rank: int, params: RaceParams, spec: PoolSpec, inq: Any, outq: Any) -> None:
    """Entry point of a prefill rank process."""
    node = _PrefillRank(rank, params, spec, outq)
    # One write before "ready": the transport opens its connection (mooncake's handshake, and
    # its reconnect backoff of 1, 2, 4 ... s if the first attempt fails) before the clock
    # starts, not inside the 50 ms budget of the first requests. Page 0 of both pools is still
    # zero, so nothing a request will verify changes.
    node.writer.write([0], [0])
    outq.put(("ready", rank))
    running, deadline = True, time.monotonic() + params.max_wall_s + 30
    while (running or node.inflight) and time.monotonic() < deadline:
        worked = False
        for _ in range(64):
            try:
                msg = inq.get_nowait()
            except queue.Empty:
                break
            running = node.on_message(msg) and running
            worked = True
        node.start_waiting()
        now = time.monotonic()
        node.issue(now)
        while node.complete_due(time.monotonic()):
            worked = True
        if not worked:
            due = node.next_due()
            wait = 0.0005 if due is None else max(0.0, min(0.0005, due - time.monotonic()))
            time.sleep(wait)
    node.writer.close()


# ---- decode ------------------------------------------------------------------------------------


@dataclass
class _Req:
    room: int
    gen: int
    start: float
    pages: list[int]
    dones: set[int] = field(default_factory=set)
    bad: bool = False


class _Decode:
    """The decode process's scheduler loop state (see the module docstring)."""

    def __init__(self, params: RaceParams, pool: DecodePool, to_ranks: list[Any]) -> None:
        self.p, self.pool, self.to_ranks = params, pool, to_ranks
        self.ledger = ReclaimLedger(mode=params.mode, upstream_timeout_s=params.upstream_timeout_s)
        self.free = list(range(params.decode_pages))
        self.rng = random.Random(params.seed)
        self.backlog: deque[int] = deque()
        self.active: OrderedDict[int, _Req] = OrderedDict()  # by start time
        self.holding: deque[tuple[float, _Req]] = deque()
        self.next_room = 0
        self.next_arrival = 0.0
        self.t0 = 0.0
        self.waits: list[float] = []
        self.ack_lags: list[float] = []
        self.res = RaceResult(mode=params.mode.value, transport=params.transport.value)
        self.ranks = list(range(params.prefill_ranks))

    def arrivals(self, now: float) -> None:
        while self.next_room < self.p.requests and self.next_arrival <= now:
            self.backlog.append(self.next_room)
            self.next_room += 1
            self.next_arrival += self.rng.expovariate(self.p.arrival_rate)

    def admit(self, now: float) -> None:
        need = self.p.pages_per_request
        while self.backlog and len(self.free) >= need:
            room = self.backlog.popleft()
            pages = [self.free.pop() for _ in range(need)]
            lease = self.ledger.track(room, pages, self.ranks)
            self.active[room] = _Req(room, lease.generation, now, pages)
            self.res.admitted += 1
            for r in self.ranks:
                idx = rank_pages(need, len(self.ranks), r)
                self.to_ranks[r].put(("req", room, lease.generation, idx, [pages[i] for i in idx]))

    def on_message(self, msg: tuple, now: float) -> None:
        if msg[0] == "ack":
            released = self.ledger.on_ack(ReclaimAck.from_dict(msg[1]))
            if released:  # time from the drained write's ack to the slots' return
                self.ack_lags.append(now - msg[2])
            self.release(released)
            return
        _, rank, room, gen = msg
        req = self.active.get(room)
        if req is None or req.gen != gen:
            return  # done for an aborted request: ignored
        req.dones.add(rank)
        if len(req.dones) == len(self.ranks):
            del self.active[room]
            self.ledger.transfer_done(room)
            req.bad = not self.verify(req)
            self.holding.append((now + self.p.decode_hold_s, req))

    def expire(self, now: float) -> None:
        while self.active:
            room, req = next(iter(self.active.items()))
            if now - req.start < self.p.budget_s:
                return
            del self.active[room]
            self.res.aborted += 1
            _count_second(self.res.aborts_per_second, now - self.t0)
            ab = self.ledger.abort(room)
            self.release(ab.released)
            if ab.notice is not None:
                for r in ab.ranks:
                    self.to_ranks[r].put(("abort", ab.notice.to_dict()))

    def finish_held(self, now: float) -> None:
        while self.holding and self.holding[0][0] <= now:
            _, req = self.holding.popleft()
            bad = req.bad or not self.verify(req)
            self.res.completed += 1
            _count_second(self.res.completions_per_second, now - self.t0)
            self.res.bad += int(bad)
            self.release([self.ledger.finish(req.room)])

    def verify(self, req: _Req) -> bool:
        want = expected_pages(req.room, req.gen, list(range(len(req.pages))), self.p.words_per_page)
        return bool(np.array_equal(self.pool.view[req.pages], want))

    def release(self, reclaims: list[Reclaim] | tuple[Reclaim, ...]) -> None:
        for rec in reclaims:
            self.free.extend(rec.slots)
            if rec.outcome != "finished":
                self.waits.append(rec.wait_s)

    def busy(self) -> bool:
        return self.next_room < self.p.requests or bool(self.backlog or self.active or self.holding)


def _count_second(per_second: list[int], elapsed: float) -> None:
    second = int(elapsed)
    per_second.extend([0] * (second + 1 - len(per_second)))
    per_second[second] += 1


def steady_throughput(res: RaceResult, burst_factor: float = 5.0) -> tuple[float, int]:
    """Completions per second over the seconds without an abort burst, and how many seconds
    were bursts (aborts above ``burst_factor`` x the median and 20): on a shared machine CPU
    starvation makes every in-flight request miss its budget at once, whatever the mode."""
    aborts = res.aborts_per_second
    done = res.completions_per_second
    seconds = max(len(aborts), len(done))
    aborts = aborts + [0] * (seconds - len(aborts))
    done = done + [0] * (seconds - len(done))
    median = sorted(aborts)[seconds // 2] if seconds else 0
    limit = max(20.0, burst_factor * median)
    calm = [d for a, d in zip(aborts[:-1], done[:-1], strict=True) if a <= limit]  # last: partial
    bursts = sum(1 for a in aborts if a > limit)
    return (sum(calm) / len(calm) if calm else 0.0), bursts


def _drain(inq: Any, limit: int = 256) -> list[tuple]:
    out = []
    for _ in range(limit):
        try:
            out.append(inq.get_nowait())
        except queue.Empty:
            break
    return out


def decode_main(params: RaceParams, pool: DecodePool, to_ranks: list[Any], inq: Any) -> RaceResult:
    """Run the decode loop until every request finished or aborted; returns the result."""
    node = _Decode(params, pool, to_ranks)
    t0 = time.monotonic()
    node.next_arrival = node.t0 = t0
    deadline = t0 + params.max_wall_s
    while node.busy():
        now = time.monotonic()
        if now > deadline:
            node.res.timed_out = True
            break
        node.arrivals(now)
        node.admit(now)
        msgs = _drain(inq)
        for msg in msgs:
            node.on_message(msg, time.monotonic())
        now = time.monotonic()
        node.expire(now)
        node.finish_held(now)
        node.release(node.ledger.poll())
        if not msgs:
            time.sleep(0.0003)
    _summarise(node, time.monotonic() - t0)
    return node.res


def _summarise(node: _Decode, wall: float) -> None:
    res = node.res
    res.wall_s = wall
    res.throughput_rps = res.completed / wall if wall else 0.0
    res.goodput_rps = (res.completed - res.bad) / wall if wall else 0.0
    res.bad_per_10k = res.bad / res.completed * 1e4 if res.completed else 0.0
    res.bad_per_10k_ci95 = wilson_interval(res.bad, res.completed)
    if node.waits:
        waits = np.array(node.waits) * 1e3
        res.abort_to_reuse_p50_ms = float(np.percentile(waits, 50))
        res.abort_to_reuse_p99_ms = float(np.percentile(waits, 99))
    if node.ack_lags:
        lags = np.array(node.ack_lags) * 1e3
        res.ack_to_reuse_p50_ms = float(np.percentile(lags, 50))
        res.ack_to_reuse_p99_ms = float(np.percentile(lags, 99))
    res.quarantine_peak_pages = node.ledger.quarantine_peak
    res.quarantined_at_end = node.ledger.quarantined_slots
    metrics = node.ledger.metrics
    res.reclaims = {
        o: int(metrics.registry.get_sample_value("cas_kv_reclaims_total", {"outcome": o}) or 0)
        for o in RECLAIM_OUTCOMES
    }
    res.ignored_messages = dict(node.ledger.ignored)


def _decode_process(
    params: RaceParams, spec_q: Any, to_ranks: list[Any], inq: Any, result_q: Any
) -> None:
    pool = DecodePool(params.transport, params.decode_pages, params.words_per_page)
    try:
        spec_q.put(pool.spec)
        ready = 0
        deadline = time.monotonic() + 60
        while ready < params.prefill_ranks and time.monotonic() < deadline:
            try:
                msg = inq.get(timeout=1.0)
            except queue.Empty:
                continue
            ready += msg[0] == "ready"
        result = decode_main(params, pool, to_ranks, inq)
        for q in to_ranks:
            q.put(("stop",))
        time.sleep(0.05)  # late writes still land in the pool while ranks wind down
        result_q.put(asdict(result))
    finally:
        pool.close()


def _get_while_alive(q: Any, proc: Any, timeout: float) -> Any:
    """Get from ``q``, failing fast with a clear error if ``proc`` died first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}") from None
    raise TimeoutError(f"no answer from {proc.name} within {timeout:.0f} s")


def run_race(params: RaceParams) -> RaceResult:
    """Spawn decode and prefill processes, run one mode, return its result."""
    ctx = mp.get_context("spawn")
    spec_q, inq, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    to_ranks = [ctx.Queue() for _ in range(params.prefill_ranks)]
    decode = ctx.Process(
        target=_decode_process, args=(params, spec_q, to_ranks, inq, result_q), name="race-decode"
    )
    decode.start()
    procs = [decode]
    try:
        spec = _get_while_alive(spec_q, decode, timeout=60.0)
        for r in range(params.prefill_ranks):
            proc = ctx.Process(
                target=prefill_main,
                args=(r, params, spec, to_ranks[r], inq),
                name=f"race-prefill-{r}",
            )
            proc.start()
            procs.append(proc)
        data = _get_while_alive(result_q, decode, timeout=params.max_wall_s + 90)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    data["bad_per_10k_ci95"] = tuple(data["bad_per_10k_ci95"])
    return RaceResult(**data)
