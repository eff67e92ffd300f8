"""Fleet overlays (pure, seeded): session start processes, think-time scaling, and the merge of
sessions into one time-ordered fleet request stream.

The Claude Code traces have no fleet arrival process (times are per session), so the caller
chooses one: `poisson_starts` (a rate; `rate_for_live_sessions` turns a live-session count into
one by Little's law), `ramp_starts` (a rate moving linearly), `burst_starts` (a rate with a
burst window) or `trace_starts` (a real arrival process, e.g. `read.mooncake_arrivals`,
rescaled to a rate; `shaped_starts` maps it onto a horizon and thins it to a rate).
`think_scaled` scales each session's think times (tool and human pauses)
by a factor. `fleet_requests(sessions, starts, seed)` assigns sessions to the start times in a
seeded random order (cycling through them when there are more starts than sessions; each
placement is a distinct session with its own block id scope) and yields `FleetRequest`s in
time order, holding only the sessions in progress (load them lazily with a `SessionPool`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from bench.traces.records import FleetRequest, TraceSession

Times = npt.NDArray[np.float64]

# ---------------------------------------------------------------- think time


def think_shrink(t: Times, think: Times, factor: float) -> Times:
    """Per request, how much earlier it comes once think times are scaled by `factor`, summed
    over the requests up to it. A request's think time is shortened by at most its gap to the
    previous request (overlapping requests keep their order); `factor` > 1 lengthens it."""
    gaps = np.maximum(np.diff(t, prepend=t[:1]), 0.0)
    spent = np.minimum(think, gaps) if factor <= 1.0 else think
    return np.asarray(np.cumsum((1.0 - factor) * spent), dtype=float)


def think_scaled(session: TraceSession, factor: float) -> TraceSession:
    """`session` (and its subagents) with every think time scaled by `factor`: each request
    moves earlier by the think time it lost (see `think_shrink`); a subagent starts earlier by
    what its parent's requests before its start lost. 1.0 returns `session` itself."""
    if factor == 1.0:
        return session
    reqs = session.requests
    t = np.array([r.t for r in reqs], dtype=float)
    shrink = think_shrink(t, np.array([r.think_s for r in reqs], dtype=float), factor)
    moved = tuple(
        replace(r, t=float(r.t - s), think_s=r.think_s * factor)
        for r, s in zip(reqs, shrink, strict=True)
    )
    subs = []
    for sub in session.subagents:
        before = int(np.searchsorted(t, sub.start_s, side="right")) - 1
        lost = float(shrink[before]) if before >= 0 else 0.0
        subs.append(replace(think_scaled(sub, factor), start_s=sub.start_s - lost))
    return replace(session, requests=moved, subagents=tuple(subs))


# ---------------------------------------------------------------- start processes


def rate_for_live_sessions(live: float, mean_duration_s: float) -> float:
    """Session starts per second that keep `live` sessions in progress on average (Little's
    law: live = rate x mean duration)."""
    return live / max(mean_duration_s, 1e-9)


def poisson_starts(rate: float, horizon_s: float, seed: int, start_s: float = 0.0) -> Times:
    """Poisson session starts at `rate` per second in [start_s, start_s + horizon_s)."""
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * horizon_s) if rate > 0 and horizon_s > 0 else 0
    return np.sort(start_s + rng.uniform(0.0, horizon_s, n))


def ramp_starts(rate_from: float, rate_to: float, horizon_s: float, seed: int) -> Times:
    """Poisson session starts whose rate moves linearly from `rate_from` to `rate_to` over
    [0, horizon_s) (thinning of the peak rate)."""
    peak = max(rate_from, rate_to)
    times = poisson_starts(peak, horizon_s, seed)
    rng = np.random.default_rng((seed, 1))
    rate_at = rate_from + (rate_to - rate_from) * times / max(horizon_s, 1e-9)
    return times[rng.uniform(0.0, peak, len(times)) < rate_at] if peak > 0 else times


def burst_starts(
    rate: float, horizon_s: float, seed: int, burst_at_s: float, burst_s: float, burst_rate: float
) -> Times:
    """Poisson starts at `rate` over [0, horizon_s), plus starts at `burst_rate` more inside
    [burst_at_s, burst_at_s + burst_s)."""
    base = poisson_starts(rate, horizon_s, seed)
    extra = poisson_starts(burst_rate, burst_s, seed + 1_000_003, start_s=burst_at_s)
    return np.sort(np.concatenate([base, extra[extra < horizon_s]]))


def trace_starts(
    arrivals: Times, rate: float | None = None, horizon_s: float | None = None
) -> Times:
    """Session starts that follow a real arrival process (`arrivals`, seconds, e.g. Mooncake's):
    time-scaled so the mean rate is `rate` (as recorded when None), repeated back to back
    until `horizon_s` (once when None). Deterministic: the randomness is the trace's."""
    times = np.sort(np.asarray(arrivals, dtype=float))
    if len(times) < 2:
        return times
    times = times - times[0]
    span = float(times[-1]) * len(times) / (len(times) - 1)  # one period, gap included
    if rate is not None and rate > 0:
        stretch = len(times) / rate / span
        times, span = times * stretch, span * stretch
    if horizon_s is None:
        return np.asarray(times, dtype=float)
    copies = int(np.ceil(horizon_s / span)) if span > 0 else 1
    tiled = np.concatenate([times + k * span for k in range(max(copies, 1))])
    return tiled[tiled < horizon_s]


def shaped_starts(arrivals: Times, rate: float, horizon_s: float, seed: int) -> Times:
    """Session starts over [0, horizon_s) shaped like a real arrival process (`arrivals`,
    seconds, e.g. Mooncake's): its times mapped linearly onto the horizon (its bursts and its
    trend kept, compressed or stretched), thinned at random (seeded) to `rate` per second on
    average (repeated whole when that asks for more than it holds)."""
    times = np.sort(np.asarray(arrivals, dtype=float))
    if len(times) < 2 or rate <= 0 or horizon_s <= 0:
        return np.zeros(0)
    span = float(times[-1] - times[0]) * len(times) / (len(times) - 1)
    mapped = (times - times[0]) / span * horizon_s
    want = rate * horizon_s / len(times)  # copies of each arrival, on average
    rng = np.random.default_rng((seed, 3))
    copies = np.floor(want).astype(int) + (rng.uniform(0.0, 1.0, len(mapped)) < want % 1.0)
    return np.sort(np.repeat(mapped, copies))


# ---------------------------------------------------------------- the fleet stream


def mean_duration_s(sessions: Sequence[TraceSession], think_scale: float = 1.0) -> float:
    """Mean `family_duration_s` of top-level sessions with think times scaled."""
    if not sessions:
        return 0.0
    return float(np.mean([think_scaled(s, think_scale).family_duration_s for s in sessions]))


def placement_order(n_sessions: int, n_starts: int, seed: int) -> list[int]:
    """Which session (index) each start gets: seeded random permutations back to back, so
    every session is used once before any is used twice."""
    rng = np.random.default_rng((seed, 2))
    order: list[int] = []
    while len(order) < n_starts and n_sessions > 0:
        order.extend(int(i) for i in rng.permutation(n_sessions))
    return order[:n_starts]


def fleet_requests(
    sessions: Sequence[TraceSession] | Sequence[str],
    starts: Times,
    seed: int,
    think_scale: float = 1.0,
    load: Callable[[str], TraceSession] | None = None,
) -> Iterator[FleetRequest]:
    """Every request of the sessions placed at `starts` (see `placement_order`), with think
    times scaled by `think_scale`, in time order. `sessions` are sessions, or keys that `load`
    turns into sessions (e.g. `SessionPool.session`) when their start comes; only sessions in
    progress are held."""
    order = placement_order(len(sessions), len(starts), seed)
    heap: list[tuple[float, int, FleetRequest, Iterator[FleetRequest]]] = []
    tie = itertools.count()

    def push(stream: Iterator[FleetRequest]) -> None:
        item = next(stream, None)
        if item is not None:
            heapq.heappush(heap, (item.time_s, next(tie), item, stream))

    for instance, (start, index) in enumerate(zip(np.sort(starts), order, strict=False)):
        while heap and heap[0][0] < start:
            _, _, item, stream = heapq.heappop(heap)
            yield item
            push(stream)
        chosen = sessions[index]
        if isinstance(chosen, str):
            if load is None:
                raise TypeError("fleet_requests: session keys need a `load` function")
            chosen = load(chosen)
        push(iter(_placed(think_scaled(chosen, think_scale), float(start), instance)))
    while heap:
        _, _, item, stream = heapq.heappop(heap)
        yield item
        push(stream)


def _placed(session: TraceSession, start: float, instance: int) -> list[FleetRequest]:
    """A session and its subagents placed at `start`, as fleet requests in time order (a
    parent's request before its subagent's at a tie)."""
    scope = f"{session.root}@{instance}"
    out = [
        FleetRequest(start + offset + r.t, f"{member.key}@{instance}", scope, turn, r)
        for offset, member in session.family()
        for turn, r in enumerate(member.requests)
    ]
    out.sort(key=lambda fr: fr.time_s)  # stable
    return out
