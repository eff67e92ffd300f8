"""Traffic, fault injection and a bare observe -> decide loop for the anomaly tests: chat
requests through the router, live faults on one sim worker (``POST /sim/fault``).

Ownership: :func:`steady_traffic` runs until its ``stop`` event is set (or ``max_requests`` were
sent), ``concurrency`` requests in flight, and appends every non-200 answer or garbled text to
``failures``; the caller owns the event and the list.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from cas_engine.sim.worker import REPEAT_JUDGED_BY_TOKENS
from cas_operator.anomaly.detect import GuardState, Policy, decide
from cas_operator.api.models import AnomalyGuardSpec
from cas_operator.observe import MetricsSource, Observation, PodTarget
from cas_operator.observe.types import PodView

TIMEOUT = aiohttp.ClientTimeout(total=30)
REPETITION_MARK = "the same line again"  # what the sim's repetition fault writes


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    failed_started: list[float] = field(default_factory=list)  # monotonic start, per failure

    def failures_started_after(self, t: float) -> list[str]:
        """Failures of requests sent at or after `t` (a request in flight on a pod that is
        being drained may still fail after the router dropped the pod: it was sent before)."""
        return [f for f, at in zip(self.failures, self.failed_started, strict=True) if at >= t]

    def failures_beyond_rare_trips(self, share: float = 0.05) -> list[str]:
        """The failures a client should not see while a decode trips the quality gate behind
        the real router: all but the gate's retryable 503s, and those too when more than
        `share` of the requests sent (at least 2) ended so. sglang-router 0.3.2 picks a retry's
        worker by its policy, the failed one included
        (tests/engine/test_sim_router.py::test_router_max_retries_counts_attempts_and_may_retry_on_the_failed_worker),
        so now and then a request spends every attempt on the faulty decode (a CI run: 1 of
        about 100); without the router's retries a sixth of them would."""
        trips = [f for f in self.failures if "cas_guard_tripped" in f]
        if len(trips) > max(2.0, share * self.sent):
            return self.failures
        return [f for f in self.failures if "cas_guard_tripped" not in f]


async def steady_traffic(
    router: str,
    stop: asyncio.Event,
    stats: LoadStats,
    *,
    concurrency: int = 6,
    max_tokens: int = 200,
    max_requests: int = 5000,
    prompt_body: str = "",
    host: str | None = None,
) -> None:
    """Keep `concurrency` chat requests in flight until `stop` is set; each prompt starts
    with a unique line, so `prompt_body` (long prompts) is never a cached prefix. `host`: the
    Host header (a fleet's hostname on a shared Gateway)."""
    headers = {"Host": host} if host else None
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=headers) as session:

        async def worker(w: int) -> None:
            while not stop.is_set() and stats.sent < max_requests:
                stats.sent += 1
                body = {
                    "model": "sim",
                    "messages": [
                        {"role": "user", "content": f"agent {w} step {stats.sent}\n{prompt_body}"}
                    ],
                    "max_tokens": max_tokens,
                }
                started = time.monotonic()
                try:
                    async with session.post(f"{router}/v1/chat/completions", json=body) as resp:
                        text = await resp.text()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    stats.failures.append(f"request error: {exc!r}")
                    stats.failed_started.append(started)
                    continue
                if resp.status != 200 or REPETITION_MARK in text:
                    stats.failures.append(f"{resp.status}: {text[:200]}")
                    stats.failed_started.append(started)
                else:
                    stats.ok += 1

        await asyncio.gather(*[worker(w) for w in range(concurrency)])


async def set_fault(url: str, spec: dict[str, float]) -> None:
    """Replace fault settings of the sim worker at `url` (raises on a non-200 answer)."""
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
        s.post(f"{url}/sim/fault", json=spec) as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"set fault on {url}: {resp.status} {await resp.text()}")


@dataclass
class LoopTrace:
    """What an observe -> decide loop did: drain orders (pod, seconds after start), per-tick
    verdicts of decode pods, and the last observation."""

    drains: list[tuple[str, float]] = field(default_factory=list)
    ticks: list[dict[str, tuple[str, float | None, str]]] = field(default_factory=list)
    last: Observation | None = None

    def report(self) -> str:
        return "\n".join(map(str, [self.drains, *self.ticks[-15:]]))


async def observe_decide_loop(
    source: MetricsSource,
    targets: list[PodTarget],
    spec: AnomalyGuardSpec,
    policy: Policy,
    *,
    seconds: float,
    tick_s: float = 1.0,
    stop_after_drains: int = 1,
) -> LoopTrace:
    """Run observe -> decide every `tick_s` for at most `seconds` (pure decide; a drained pod
    just leaves rotation, as the act step's label removal does)."""
    trace, state = LoopTrace(), GuardState()
    start = time.monotonic()
    while time.monotonic() - start < seconds and len(trace.drains) < stop_after_drains:
        await asyncio.sleep(tick_s)
        obs = await asyncio.to_thread(source.observe, targets, float(spec.window_seconds))
        drained = {name for name, _ in trace.drains}
        views = [
            PodView(t.name, t.role, True, t.name not in drained, None, obs.signals[t.name])
            for t in targets
        ]
        decision = decide(spec, views, state, time.monotonic(), policy)
        state = decision.state
        trace.drains += [(o.name, time.monotonic() - start) for o in decision.drains]
        decode = {n: v for n, v in decision.verdicts.items() if v.role == "decode"}
        trace.ticks.append({n: (v.state, v.rate, v.reason) for n, v in decode.items()})
        trace.last = obs
    return trace


async def loop_under_repetition_fault(
    router_url: str,
    faulty_url: str,
    source: MetricsSource,
    targets: list[PodTarget],
    policy: Policy,
    *,
    seconds: float,
) -> tuple[LoopTrace, LoadStats]:
    """Steady traffic through `router_url` while the sim at `faulty_url` repeats itself half
    the time; run the observe -> decide loop meanwhile, then clear the fault and stop."""
    stop, stats = asyncio.Event(), LoadStats()
    load = asyncio.create_task(
        steady_traffic(router_url, stop, stats, max_tokens=REPEAT_JUDGED_BY_TOKENS)
    )
    await set_fault(faulty_url, {"repetition": 0.5})
    try:
        trace = await observe_decide_loop(
            source, targets, AnomalyGuardSpec(window_seconds=60), policy, seconds=seconds
        )
    finally:
        await set_fault(faulty_url, {"repetition": 0.0})
        stop.set()
        await load
    return trace, stats
