"""The sim worker's scheduler: prefill queue, PD hand-off, the decode batch loop, the guard.

Data flow for one request (the HTTP layer in :mod:`.server` parses it into a :class:`GenRequest`
and reads :class:`Event` objects from the returned :class:`Run`'s queue until a final one):

- ``null`` mode: prefill (prefix cache + cost model, one prefill at a time) -> decode batch.
- ``prefill`` mode: prefill -> KV write to the decode named by the bootstrap room -> final event.
- ``decode`` mode: KV slot + bootstrap registration -> wait for the transfer (prefill budget)
  -> content check -> decode batch.

The decode loop (one asyncio task) paces steps by the cost model: each step every running
request draws its accepted draft tokens (a seeded chain of Bernoulli trials: healthy, collapsed
when its KV slot no longer holds its content, near 1 when it degenerates into repetition), emits
accepted + 1 tokens, and the whole batch goes through the real :class:`GuardMonitor` in one call;
tripped requests end with the guard's retryable error. Ownership: the worker owns every
:class:`Run` until its final event; the HTTP handler only reads the queue (and may cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from cas_engine.guard import GuardConfig, GuardMetrics, GuardMonitor, GuardTrip
from cas_engine.kvfence import KvFenceMetrics, ReclaimLedger, ReclaimMode, WriteTracker
from cas_engine.kvfence.gone_feed import GoneFeed, GoneFeedMetrics, GonePrefill
from cas_engine.kvfence.peer_probe import PeerProbeMetrics, PeerProber
from cas_engine.prefixreuse import ReuseMetrics, ReuseTracker
from cas_engine.sim.config import SimConfig
from cas_engine.sim.faults import Faults, parse_faults
from cas_engine.sim.kvpool import KvPool, expected_kv
from cas_engine.sim.metrics import SimMetrics
from cas_engine.sim.pd import DecodeKv, PrefillKv, make_transport
from cas_engine.sim.prefix_cache import PrefixCache
from cas_engine.sim.textgen import TokenStream, request_seed
from cas_engine.sim.timing import decode_step_seconds, prefill_seconds

log = logging.getLogger("cas_engine.sim.worker")

CORRUPTED_ACCEPT_PROB = 0.05
PREFILL_CHUNK_TOKENS = 16384  # new tokens per prefill batch (SGLang --chunked-prefill-size)
REPEAT_ACCEPT_PROB = 0.998
# An answer of at least this many tokens that degenerates into repetition is always aborted by
# the gate (default config) before its last token: the gate judges only past 144 tokens (128
# generated; 96 + 48 for the repetition evidence), and at 200 a few early rejected drafts kept
# 12 of 20,000 repetitions at or under its accept-rate line to the end. Tests that assert no
# client sees a repetition ask for answers this long.
REPEAT_JUDGED_BY_TOKENS = 400
# An idle loop sleeps until work wakes it (a request queued, /metrics refreshes the gauges
# itself); this is only its safety net. Each wake-up costs ~1 ms of CPU on a busy 2-core
# machine: at 0.5 s, two loops cost an idle sim ~1.1% of a core (0.55-0.85% now), and the
# e2e suite keeps dozens of sims alive at a time.
IDLE_WAKE_S = 5.0
TIMER_POLL_S = 0.5  # the Upstream reclaim timer's tick (DecodeKv.poll), which needs no request
# A verbatim copy: the draft model predicts nearly every token. An assumed figure, chosen above
# the gate's 0.96 accept-rate limit: the case where the rate alone would abort a healthy copy.
COPY_ACCEPT_PROB = 0.985


def accepted_drafts(rng: random.Random, drafts: int, accept_prob: float) -> int:
    """Drafts one verify step accepts: each in turn with `accept_prob`, up to the first
    rejection (speculative decoding's prefix rule)."""
    acc = 0
    while acc < drafts and rng.random() < accept_prob:
        acc += 1
    return acc


@dataclass(frozen=True, slots=True)
class GenRequest:
    """A parsed generation request (any endpoint)."""

    rid: str
    tokens: np.ndarray
    max_new_tokens: int
    sampling_seed: int | None = None
    bootstrap: tuple[str, int, int] | None = None  # host, port, room


@dataclass(frozen=True, slots=True)
class Event:
    """``tokens`` (pieces), ``finish`` (reason), ``trip`` (guard) or ``error`` (status, msg)."""

    kind: str
    pieces: tuple[str, ...] = ()
    reason: str = ""
    status: int = 0
    message: str = ""
    trip: GuardTrip | None = None


@dataclass(slots=True, eq=False)
class Run:
    """One request in flight; the worker owns it until it puts a final event."""

    req: GenRequest
    out: asyncio.Queue[Event]
    stream: TokenStream
    spec: random.Random
    accept_prob: float
    t_start: float
    cached_tokens: int = 0
    generated: int = 0
    verify_ct: int = 0
    accepted: int = 0
    guard_slot: int = -1
    kv_slot: int | None = None
    expected: bytes = b""
    corrupted: bool = False
    cancelled: bool = False
    num_draft: int = 3
    t_first: float = 0.0
    t_last: float = 0.0
    final: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_tokens(self) -> int:
        return len(self.req.tokens) + self.generated

    def meta_info(self) -> dict[str, Any]:
        """SGLang ``meta_info`` fields (plus ``simulated``)."""
        steps = self.verify_ct
        return {
            "id": self.req.rid,
            "prompt_tokens": len(self.req.tokens),
            "completion_tokens": self.generated,
            "cached_tokens": self.cached_tokens,
            "spec_verify_ct": steps,
            "spec_accept_length": (self.accepted + steps) / steps if steps else None,
            "spec_accept_rate": (
                self.accepted / (steps * self.num_draft) if steps and self.num_draft else None
            ),
            "e2e_latency": time.monotonic() - self.t_start,
            "simulated": True,
            **self.meta,
        }


class SimWorker:
    """Scheduler and state of one simulated SGLang worker."""

    def __init__(self, cfg: SimConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.faults: Faults = parse_faults(cfg.fault)
        self.metrics = SimMetrics(self.registry, cfg.model_name, cfg.mode)
        self.m = cfg.model_name
        self.cache = PrefixCache(cfg.timing.block_size, cfg.timing.kv_capacity_tokens)
        # the prompt reuse times the operator's hit-rate model reads (as SGLang's prefill does)
        self.reuse = ReuseTracker(metrics=ReuseMetrics(self.registry))
        self.guard = self._make_guard()
        self.rng = np.random.default_rng(cfg.seed)
        self.fence_metrics = KvFenceMetrics(self.registry)
        self.incarnation = uuid.uuid4().hex  # this process; peers tell a restart by it
        self._prefill_queue: list[tuple[Run, asyncio.Future[None]]] = []
        self._prefill_wake = asyncio.Event()
        self._waiting: list[Run] = []
        self._running: list[Run] = []
        self._wake = asyncio.Event()
        self._kv_used = 0
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.decode_kv: DecodeKv | None = None
        self.prefill_kv: PrefillKv | None = None
        self.gone_feed: GoneFeed | None = None
        self.stats: dict[str, int] = {
            "requests": 0,
            "finished": 0,
            "aborted": 0,
            "guard_trips": 0,
            "kv_corrupted": 0,
            "kv_timeouts": 0,
            "generated_tokens": 0,
        }
        self._last_step_at = 0.0
        self.gen_rate = 0.0
        self._busy_model_s = 0.0  # modelled wall time of the decode steps run so far
        self._busy_real_s = 0.0  # wall time those steps actually took
        self._last_accept = (float("nan"), float("nan"))

    def _make_guard(self) -> GuardMonitor:
        from dataclasses import replace

        from cas_engine.guard import guard_config_from_args

        gcfg = (
            guard_config_from_args(self.cfg.guard_args)
            if self.cfg.guard_args is not None
            else GuardConfig.from_env()
        )
        if not self.cfg.guard_enabled:
            gcfg = replace(gcfg, enabled=False)
        capacity = self.cfg.max_running_requests + 64
        return GuardMonitor(gcfg, capacity, metrics=GuardMetrics.create(self.registry, gcfg))

    # ---- lifecycle ------------------------------------------------------------------------

    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "worker not started"
        return self._http

    async def start(self) -> None:
        """Create the HTTP client, the KV parts of the mode and the decode loop."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        host = advertised_host(self.cfg.host)
        url = f"http://{host}:{self.cfg.port}"
        if self.cfg.mode == "decode":
            transport = make_transport(host, url, self.http)
            pool = KvPool(self.cfg.kv_slots, self.cfg.kv_slot_bytes)
            transport.register(pool)
            ledger = ReclaimLedger(
                mode=ReclaimMode.parse(self.cfg.kv_reclaim),
                upstream_timeout_s=self.cfg.upstream_release_timeout_s,
                metrics=self.fence_metrics,
                clock=self.sim_clock,
            )
            self.decode_kv = DecodeKv(
                pool=pool,
                transport=transport,
                ledger=ledger,
                http=self.http,
                self_url=url,
                prober=PeerProber(metrics=PeerProbeMetrics(self.registry)),
            )
            self.decode_kv.gone_clock_skew_s = self.cfg.gone_clock_skew_s
            if self.cfg.prefill_gone_file:
                self._start_gone_feed(self.decode_kv)
        elif self.cfg.mode == "prefill":
            transport = make_transport(host, url, self.http)
            staging = KvPool(self.cfg.kv_slots, self.cfg.kv_slot_bytes)
            transport.register(staging)
            self.prefill_kv = PrefillKv(
                staging=staging,
                transport=transport,
                tracker=WriteTracker(0, metrics=self.fence_metrics),
                http=self.http,
                faults=self.faults,
                wall=self.cfg.wall,
                rng=self.rng,
            )
        self._spawn(self._decode_loop())
        self._spawn(self._prefill_loop())

    def _start_gone_feed(self, kv: DecodeKv) -> None:
        """Read the operator's prefill-gone feed in a thread; entries reach ``kv`` on the loop."""
        loop = asyncio.get_running_loop()

        def deliver(gone: GonePrefill) -> None:  # feed thread -> event loop
            loop.call_soon_threadsafe(kv.on_prefill_gone, gone)

        self.gone_feed = GoneFeed(
            Path(self.cfg.prefill_gone_file), deliver, metrics=GoneFeedMetrics(self.registry)
        )
        self.gone_feed.start()

    async def stop(self) -> None:
        if self.gone_feed is not None:
            self.gone_feed.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.decode_kv is not None:
            await self.decode_kv.close()
        if self._http is not None:
            await self._http.close()

    def sim_clock(self) -> float:
        """Modelled seconds (wall clock x speedup), the kvfence ledger's clock."""
        return time.monotonic() * self.cfg.speedup

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- submission -----------------------------------------------------------------------

    def submit(self, req: GenRequest) -> Run:
        """Start ``req``; read its events from ``run.out``."""
        seed = request_seed(req.tokens, req.sampling_seed, self.cfg.seed)
        run = Run(
            req=req,
            out=asyncio.Queue(),
            stream=TokenStream(seed),
            spec=random.Random(seed ^ 0x5EED),
            accept_prob=self.cfg.spec_accept_prob,
            t_start=time.monotonic(),
            num_draft=self.cfg.spec_num_steps,
        )
        self.stats["requests"] += 1
        self.metrics.prompt_tokens.labels(self.m).inc(len(req.tokens))
        if self.faults.repetition_rate and self.rng.random() < self.faults.repetition_rate:
            run.stream.set_style("repeat")
            run.accept_prob = REPEAT_ACCEPT_PROB
        elif self.faults.decode_corruption and self.rng.random() < self.faults.decode_corruption:
            self._corrupt(run, "read from bad KV memory")
        elif self.faults.copy_rate and self.rng.random() < self.faults.copy_rate:
            run.stream.set_style("copy")
            run.accept_prob = COPY_ACCEPT_PROB
        self._spawn(self._serve(run))
        return run

    async def _serve(self, run: Run) -> None:
        try:
            if self.cfg.mode == "prefill":
                await self._serve_prefill(run)
            elif self.cfg.mode == "decode":
                await self._serve_decode(run)
            else:
                await self._prefill(run)
                self._enqueue(run)
        except Exception as exc:  # one request's failure never stops the worker
            log.exception("request %s failed", run.req.rid)
            self._final(run, Event("error", status=500, message=f"sim internal error: {exc}"))

    async def _prefill(self, run: Run) -> None:
        """Queue ``run`` for the prefill loop; return once its prefill batch has run."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._prefill_queue.append((run, fut))
        self._prefill_wake.set()
        await fut

    async def _prefill_loop(self) -> None:
        """Batched prefill: take queued requests FIFO up to the chunk budget of new tokens,
        look each up in the prefix cache, sleep the batch's modelled time, release them."""
        timing = self.cfg.timing
        while True:
            if self.faults.hang or not self._prefill_queue:
                self._prefill_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._prefill_wake.wait(), 0.05 if self.faults.hang else IDLE_WAKE_S
                    )
                continue
            batch: list[asyncio.Future[None]] = []
            new_total, seconds = 0, timing.prefill_overhead_ms / 1000.0
            while self._prefill_queue and (not batch or new_total < PREFILL_CHUNK_TOKENS):
                run, fut = self._prefill_queue.pop(0)
                if fut.done():
                    continue
                tokens = run.req.tokens
                self.reuse.observe(tokens)
                hit = self.cache.match_and_insert(tokens)
                run.cached_tokens = hit
                self.metrics.cached_tokens.labels(self.m).inc(hit)
                new = len(tokens) - hit
                new_total += new
                seconds += prefill_seconds(timing, new, len(tokens)) - (
                    timing.prefill_overhead_ms / 1000.0
                )
                batch.append(fut)
            await asyncio.sleep(self.cfg.wall(seconds * self.faults.slow_prefill))
            for fut in batch:
                if not fut.done():
                    fut.set_result(None)

    async def _serve_prefill(self, run: Run) -> None:
        assert self.prefill_kv is not None
        if run.req.bootstrap is None:
            self._final(
                run,
                Event("error", status=400, message="prefill worker needs bootstrap_room/host/port"),
            )
            return
        await self._prefill(run)
        room = run.req.bootstrap[2]
        ok = await self.prefill_kv.transfer(
            room, run.req.tokens, self.cfg.wall(self.cfg.prefill_budget_s), run.cached_tokens
        )
        run.meta["kv_transferred"] = ok
        self._final(run, Event("finish", reason="length"))

    async def _serve_decode(self, run: Run) -> None:
        kv = self.decode_kv
        assert kv is not None
        if run.req.bootstrap is None:
            self._final(
                run,
                Event("error", status=400, message="decode worker needs bootstrap_room/host/port"),
            )
            return
        host, port, room = run.req.bootstrap
        budget = self.cfg.wall(self.cfg.prefill_budget_s)
        slot = await kv.acquire(room, host, port, budget)
        if slot is None:
            self.metrics.bootstrap_failed.labels(self.m).inc()
            self._fail_transfer(run, "no KV slot or bootstrap registration within the budget")
            return
        cached = await kv.wait_done(room, budget)
        if cached is None:
            kv.abort(room, host, port)
            self.metrics.transfer_failed.labels(self.m).inc()
            self._fail_transfer(run, "KV transfer missed the prefill time budget")
            return
        run.cached_tokens = cached
        run.kv_slot = slot
        run.expected = expected_kv(run.req.tokens, kv.pool.slot_bytes)
        self._check_kv(run)
        self._enqueue(run)

    def _fail_transfer(self, run: Run, why: str) -> None:
        self.stats["kv_timeouts"] += 1
        self._final(run, Event("error", status=503, message=f"sim decode abort: {why}"))

    # ---- decode batch ---------------------------------------------------------------------

    def _enqueue(self, run: Run) -> None:
        self._waiting.append(run)
        self._wake.set()

    def _admit(self) -> None:
        cap = self.cfg.timing.kv_capacity_tokens
        still: list[Run] = []
        for run in self._waiting:
            if run.cancelled:
                self._release_kv(run)
                self._final(run, Event("error", status=499, message="client disconnected"))
            elif len(self._running) < self.cfg.max_running_requests and (
                self._kv_used + run.kv_tokens <= cap or not self._running
            ):
                run.guard_slot = self.guard.allocate(run.req.rid)
                self._kv_used += len(run.req.tokens)
                self._running.append(run)
            else:
                still.append(run)
        self._waiting = still

    async def _decode_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if self.decode_kv is not None:
                self.decode_kv.poll()
            if self.faults.hang:
                await asyncio.sleep(0.05)
                continue
            self._admit()
            self._refresh_gauges()
            if not self._running:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._idle_wake_s())
                next_at = loop.time()
                continue
            t0 = loop.time()
            dt = self.cfg.wall(
                decode_step_seconds(self.cfg.timing, len(self._running), self._kv_used)
                * self.faults.slow_decode
            )
            next_at = max(next_at, t0 - 0.05) + dt
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            self._step()
            self._busy_model_s += dt
            self._busy_real_s += loop.time() - t0

    def _idle_wake_s(self) -> float:
        """How long the idle decode loop may sleep: the Upstream reclaim mode releases
        quarantined slots on a timer, which only this loop's `DecodeKv.poll` ticks."""
        kv = self.decode_kv
        upstream = kv is not None and kv.ledger.mode is ReclaimMode.UPSTREAM
        return TIMER_POLL_S if upstream else IDLE_WAKE_S

    def _check_kv(self, run: Run) -> None:
        """Collapse the request's statistics once its KV slot stops holding its content."""
        kv = self.decode_kv
        if run.corrupted or kv is None or run.kv_slot is None:
            return
        if not kv.pool.holds(run.kv_slot, run.expected):
            self._corrupt(run, f"KV slot {run.kv_slot} does not hold its content")

    def _corrupt(self, run: Run, why: str) -> None:
        """The request decodes from corrupted KV: garbled text, collapsed draft acceptance."""
        run.corrupted = True
        run.stream.set_style("garbled")
        run.accept_prob = CORRUPTED_ACCEPT_PROB
        self.stats["kv_corrupted"] += 1
        self.metrics.kv_corrupted.labels(self.m).inc()
        log.warning("request %s: %s (corrupted)", run.req.rid, why)

    def _step(self) -> None:
        """One decode/verify step of the whole batch."""
        now = time.monotonic()
        steps = self.cfg.spec_num_steps
        slots: list[int] = []
        accepted: list[int] = []
        done: list[Run] = []
        emitted = 0
        for run in self._running:
            if run.cancelled:
                done.append(run)
                continue
            self._check_kv(run)
            acc = accepted_drafts(run.spec, steps, run.accept_prob)
            n = min(acc + 1, run.req.max_new_tokens - run.generated)
            self._emit(run, run.stream.take(n), now)
            emitted += n
            run.verify_ct += 1
            run.accepted += acc
            slots.append(run.guard_slot)
            accepted.append(acc)
            if run.generated >= run.req.max_new_tokens:
                done.append(run)
        self._account_step(accepted, steps, emitted)
        for trip in self.guard.observe(slots, accepted, [steps] * len(slots), self._output_ids):
            self._trip(trip)
        for run in done:
            if not run.final:
                reason = "abort" if run.cancelled else "length"
                self._end(run, Event("finish", reason=reason))

    def _output_ids(self, slot: int) -> Sequence[int]:
        """A running request's last output token ids (the gate's repetition rule asks only
        for a request over its accept-rate limit)."""
        run = next(r for r in self._running if r.guard_slot == slot)
        return list(run.stream.ids)

    def _emit(self, run: Run, pieces: list[str], now: float) -> None:
        if run.generated == 0:
            run.t_first = now
            self.metrics.ttft.labels(self.m).observe(now - run.t_start)
        else:
            # As SGLang (metrics_collector.py:2161-2173): the chunk's interval over its tokens,
            # observed once per token.
            itl = self.metrics.itl.labels(self.m)
            for _ in range(max(1, len(pieces))):
                itl.observe((now - run.t_last) / max(1, len(pieces)))
        run.t_last = now
        run.generated += len(pieces)
        self._kv_used += len(pieces)
        run.out.put_nowait(Event("tokens", pieces=tuple(pieces)))

    def _account_step(self, accepted: list[int], steps: int, emitted: int) -> None:
        self.stats["generated_tokens"] += emitted
        self.metrics.generation_tokens.labels(self.m).inc(emitted)
        if accepted:
            mean_acc = sum(accepted) / len(accepted)
            self._last_accept = (mean_acc + 1.0, mean_acc / steps)
        now = time.monotonic()
        if self._last_step_at:
            rate = emitted / max(1e-6, now - self._last_step_at) * self.cfg.speedup
            self.metrics.gen_throughput.labels(self.m).set(rate)  # modelled tokens/s
            self.gen_rate = rate
        self._last_step_at = now

    def _trip(self, trip: GuardTrip) -> None:
        for run in self._running:
            if run.guard_slot == trip.slot and not run.final:
                log.warning("guard trip: %s", trip.message())
                self.stats["guard_trips"] += 1
                self._end(run, Event("trip", trip=trip))
                return

    def _end(self, run: Run, event: Event) -> None:
        """Remove a running request, release its guard slot and KV, post its final event."""
        self._running.remove(run)
        self._kv_used -= run.kv_tokens
        self.guard.finish(run.guard_slot)
        self._release_kv(run)
        self._final(run, event)

    def _release_kv(self, run: Run) -> None:
        """Return a decode run's KV slot (its transfer completed, so at once)."""
        if self.decode_kv is not None and run.kv_slot is not None and run.req.bootstrap:
            self.decode_kv.finish(run.req.bootstrap[2])
            run.kv_slot = None

    def _final(self, run: Run, event: Event) -> None:
        if run.final:
            return
        run.final = True
        self.metrics.requests.labels(self.m).inc()
        if event.kind == "finish" and event.reason == "length":
            self.stats["finished"] += 1
            self.metrics.e2e.labels(self.m).observe(time.monotonic() - run.t_start)
        else:
            self.stats["aborted"] += 1
            self.metrics.aborted.labels(self.m).inc()
        run.out.put_nowait(event)

    def _refresh_gauges(self) -> None:
        m, lab = self.metrics, self.m
        m.running.labels(lab).set(len(self._running))
        m.queued.labels(lab).set(len(self._waiting) + len(self._prefill_queue))
        m.used_tokens.labels(lab).set(self._kv_used)
        m.token_usage.labels(lab).set(self._kv_used / self.cfg.timing.kv_capacity_tokens)
        if self.cache.total_tokens:
            m.cache_hit_rate.labels(lab).set(self.cache.hit_tokens / self.cache.total_tokens)
        length, rate = self._last_accept
        if length == length:
            m.accept_length.labels(lab).set(length)
            m.accept_rate.labels(lab).set(rate)
        if self.decode_kv is not None:
            m.decode_prealloc.labels(lab).set(self.decode_kv.pool.waiting)
            m.decode_transfer.labels(lab).set(self.decode_kv.transfer_queue)
        if self.prefill_kv is not None:
            m.prefill_bootstrap.labels(lab).set(self.prefill_kv.bootstrap_queue)
            m.prefill_inflight.labels(lab).set(self.prefill_kv.inflight)

    @property
    def avg_accept_length(self) -> float | None:
        """Mean accept length of the last decode step (None before the first)."""
        length = self._last_accept[0]
        return None if length != length else length

    def cancel(self, run: Run) -> None:
        """The client went away: the request ends at the next step."""
        run.cancelled = True

    def snapshot(self) -> dict[str, Any]:
        """JSON-able counters for ``/sim/stats`` and ``/get_server_info``."""
        out: dict[str, Any] = dict(self.stats)
        # 1.0: decode steps ran at the modelled pace; below 1: the sim itself is the bottleneck
        out["decode_realtime_factor"] = (
            self._busy_model_s / self._busy_real_s if self._busy_real_s else 1.0
        )
        out.update(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_used_tokens=self._kv_used,
            faults=self.faults.as_dict(),
            cache_hit_rate=(
                self.cache.hit_tokens / self.cache.total_tokens if self.cache.total_tokens else 0.0
            ),
        )
        if self.decode_kv is not None:
            ledger = self.decode_kv.ledger
            out.update(
                kv_free_slots=self.decode_kv.pool.free_slots,
                kv_quarantined_slots=ledger.quarantined_slots,
                kv_reclaim_mode=ledger.mode.value,
                kv_transport=type(self.decode_kv.transport).__name__,
            )
        if self.prefill_kv is not None:
            out.update(
                stalled_writes=self.prefill_kv.stalled_writes,
                pinned_rooms=self.prefill_kv.tracker.pinned_rooms,
            )
        return out


def advertised_host(bind: str) -> str:
    """The address peers use to reach a worker bound to ``bind`` (wildcards -> loopback)."""
    return "127.0.0.1" if bind in ("", "0.0.0.0", "::") else bind


def new_rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
