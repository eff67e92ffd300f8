"""Send real sessions through a fleet's entry point, closed loop, and measure what it served.

Data flow: a `sources.Source` (session instances with their start times and block id scopes:
Claude Code sessions at Poisson starts, or Mooncake's requests at their arrivals) -> one task per
session member (a session and each subagent): its requests in order, each sent when the
previous one has been answered and its think time (times `scale.think`) has passed; a
subagent starts after the parent's request before it was answered, plus the rest of its gap
-> each request: `prompts.prompt_for` (the session instance's block id scope, so the router
and the engines see the trace's reuse), one streaming chat request to ``{url}/v1/chat/
completions`` carrying the session's routing key in `routing_headers`; the same prompt's
tokens go to the `LruBound` in the order sent -> one `Outcome` per request (TTFT, the
engine's prompt and cached tokens from the usage chunk, the bound's hit, the prefill that
served it when the sim says) -> `summarize`.

Bounded: the source's instances, `max_turns` requests per member, nothing sent after
`duration_s`, `max_in_flight` requests at once, `timeout_s` per request; `Replay.stop` ends it
at once (requests in flight are abandoned). Ownership: a `Replay` owns its tasks and HTTP
session; `outcomes` and `progress` are read by the caller (the view reads them from another
thread: a lock guards them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from bench.replay.bound import LruBound
from bench.replay.prompts import Prompt, Scale, prompt_for
from bench.replay.sources import Placement, Source
from bench.traces import TraceSession

# Headers that carry the session id: what Claude Code sends (X-Claude-Code-Session-Id, one UUID
# per session, since v2.1.86) and smg's own routing-key header.
SESSION_HEADERS = ("X-Claude-Code-Session-Id", "X-SMG-Routing-Key")


@dataclass(frozen=True)
class ReplayConfig:
    """What to send, where, and the bounds (see the module docstring)."""

    url: str
    model: str
    pool_capacity_tokens: int  # every prefill's prefix cache together: the bound's capacity
    scale: Scale = field(default_factory=Scale)
    duration_s: float | None = None
    max_turns: int | None = None
    routing_headers: tuple[str, ...] = SESSION_HEADERS
    connection_per_request: bool = True  # else one keep-alive pool (requests share connections)
    max_in_flight: int = 128
    timeout_s: float = 120.0
    ttft_slo_s: float = 4.0  # goodput: answered requests whose TTFT is within this (wall)
    api_key: str = ""


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent (s from the replay's start), how it ended, and the
    prompt tokens the engine reported against the tokens the bound counted."""

    session: str
    sent_s: float
    ok: bool
    error: str
    ttft_s: float | None
    latency_s: float
    expected_tokens: int
    prompt_tokens: int
    cached_tokens: int
    bound_hit: int
    output_tokens: int
    prefill: str | None


@dataclass
class Replay:
    """See the module docstring. Run `run()` in an event loop (or `start_thread()`)."""

    config: ReplayConfig
    source: Source
    outcomes: list[Outcome] = field(default_factory=list)
    started_sessions: int = 0
    finished_sessions: int = 0
    _bound: LruBound = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _t0: float = field(default_factory=time.monotonic)
    _sem: asyncio.Semaphore | None = None
    _stopped: bool = False
    _task: asyncio.Task[None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._bound = LruBound(self.config.pool_capacity_tokens)

    # ---- running ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Every placement's session, bounded; returns when all are done or stopped."""
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self._t0 = time.monotonic()
        self._sem = asyncio.Semaphore(self.config.max_in_flight)
        cfg = self.config
        connector = aiohttp.TCPConnector(
            limit=cfg.max_in_flight, force_close=cfg.connection_per_request
        )
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        with contextlib.suppress(asyncio.CancelledError):
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
                await asyncio.gather(*(self._session(http, p) for p in self.source.places))

    def start_thread(self) -> Replay:
        """Run in a thread of its own (the demo's view reads `snapshot()` meanwhile)."""
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.run()), name="replay", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """End now: nothing more is sent; requests in flight are abandoned."""
        self._stopped = True
        if self._loop is not None and self._task is not None:
            # a replay that ran out has closed its loop: nothing left to cancel
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(10.0)

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    async def _wait(self, seconds: float) -> bool:
        """Sleep `seconds`; False, at once, when the replay would be over by then."""
        limit = self.config.duration_s
        if self._stopped or (limit is not None and self.elapsed_s() + seconds >= limit):
            return False
        await asyncio.sleep(max(0.0, seconds))
        return not self._stopped

    async def _session(self, http: aiohttp.ClientSession, place: Placement) -> None:
        if not await self._wait(place.start_s - self.elapsed_s()):
            return
        session = self.source.session(place.key)
        with self._lock:
            self.started_sessions += 1
        await self._member(http, session, place, None, 0.0)
        with self._lock:
            self.finished_sessions += 1

    async def _member(
        self,
        http: aiohttp.ClientSession,
        member: TraceSession,
        place: Placement,
        after: asyncio.Event | None,
        delay_s: float,
    ) -> None:
        """One member's requests in closed loop; its subagents start as the module says."""
        if after is not None:
            await after.wait()
        if not await self._wait(delay_s):
            return
        requests = member.requests[: self.config.max_turns]
        answered = [asyncio.Event() for _ in requests]
        subs = [self._subagent(http, sub, member, place, answered) for sub in member.subagents]
        tasks = [asyncio.ensure_future(s) for s in subs]
        try:
            for turn, request in enumerate(requests):
                think = request.think_s * self.config.scale.think if turn else 0.0
                if not await self._wait(think):
                    break
                label = f"{place.scope}/{member.key}#{turn}"
                prompt = prompt_for(request, place.scope, label, self.config.scale)
                await self._send(http, prompt, place)
                answered[turn].set()
        finally:
            for event in answered:
                event.set()  # subagents waiting on an unsent turn start (and stop) now
            await asyncio.gather(*tasks, return_exceptions=True)

    def _subagent(
        self,
        http: aiohttp.ClientSession,
        sub: TraceSession,
        parent: TraceSession,
        place: Placement,
        answered: list[asyncio.Event],
    ) -> Any:
        """A subagent starts once the parent's last request before its start is answered,
        plus the rest of its gap on the trace's clock (times the think scale)."""
        times = [r.t for r in parent.requests[: len(answered)]]
        before = int(np.searchsorted(np.array(times), sub.start_s, side="right")) - 1
        if before < 0:
            return self._member(http, sub, place, None, sub.start_s * self.config.scale.think)
        req = parent.requests[before]
        gap = max(0.0, sub.start_s - req.t - (req.api_s or 0.0))
        return self._member(http, sub, place, answered[before], gap * self.config.scale.think)

    # ---- one request ------------------------------------------------------------------------

    async def _send(self, http: aiohttp.ClientSession, prompt: Prompt, place: Placement) -> None:
        cfg = self.config
        assert self._sem is not None
        async with self._sem:
            tokens = prompt.tokens()
            hit = self._bound.observe(tokens)  # in the order sent
            sent = self.elapsed_s()
            outcome = await _chat(http, cfg, prompt, place.scope, sent, len(tokens), hit)
        with self._lock:
            self.outcomes.append(outcome)

    # ---- reading ----------------------------------------------------------------------------

    def snapshot(self, slo_s: float | None = None) -> dict[str, Any]:
        """`summarize` of what has been answered so far (thread-safe)."""
        with self._lock:
            outcomes = list(self.outcomes)
            started, finished = self.started_sessions, self.finished_sessions
        out = summarize(outcomes, self.elapsed_s(), slo_s or self.config.ttft_slo_s)
        return {**out, "sessions_started": started, "sessions_finished": finished}


async def _chat(
    http: aiohttp.ClientSession,
    cfg: ReplayConfig,
    prompt: Prompt,
    session: str,
    sent_s: float,
    expected: int,
    bound_hit: int,
) -> Outcome:
    """One streaming chat request; its outcome (an error outcome on any failure)."""
    body = {
        "model": cfg.model,
        "messages": prompt.messages(),
        "max_tokens": prompt.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {h: session for h in cfg.routing_headers}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    t0 = time.monotonic()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    prefill: str | None = None

    def failed(error: str) -> Outcome:
        return Outcome(session, sent_s, False, error, ttft, time.monotonic() - t0, expected,
                       0, 0, bound_hit, 0, prefill)  # fmt: skip

    try:
        async with http.post(f"{cfg.url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                return failed(f"HTTP {r.status}")
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return failed(str(event["error"].get("type") or "stream error"))
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                usage = event.get("usage") or usage
                pair = (event.get("metadata") or {}).get("pd_pair") or {}
                prefill = pair.get("prefill", prefill)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return failed(type(exc).__name__)
    if not usage:
        return failed("no usage in the stream")
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        session, sent_s, True, "", ttft, time.monotonic() - t0, expected,
        int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0), bound_hit,
        int(usage.get("completion_tokens", 0)), prefill,
    )  # fmt: skip


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.array(values), q * 100))


def summarize(outcomes: list[Outcome], elapsed_s: float, ttft_slo_s: float) -> dict[str, Any]:
    """Requests, errors (by kind), achieved prefix hit rate (engines' cached tokens over
    prompt tokens of the answered requests), the bound's over the same requests, TTFT p50/p90
    (s) and goodput (answered requests within the TTFT SLO, per second)."""
    ok = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error] = errors.get(o.error, 0) + 1
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    expected = sum(o.expected_tokens for o in ok)
    bound = sum(o.bound_hit for o in ok)
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    achieved = cached / prompt if prompt else None
    bound_rate = bound / expected if expected else None
    per_prefill: dict[str, int] = {}
    for o in ok:
        if o.prefill:
            per_prefill[o.prefill] = per_prefill.get(o.prefill, 0) + 1
    return {
        "requests": len(outcomes),
        "answered": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_kinds": errors,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_mismatches": sum(o.prompt_tokens != o.expected_tokens for o in ok),
        "achieved_hit_rate": achieved,
        "bound_hit_rate": bound_rate,
        "ratio": achieved / bound_rate if achieved is not None and bound_rate else None,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "goodput_rps": sum(t <= ttft_slo_s for t in ttfts) / elapsed_s if elapsed_s > 0 else 0.0,
        "elapsed_s": elapsed_s,
        "requests_per_prefill": per_prefill,
    }


def progress_line(s: dict[str, Any]) -> str:
    """One line for the terminal."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}ms"

    return (
        f"{s['elapsed_s']:6.0f}s  sessions {s['sessions_started']} started "
        f"{s['sessions_finished']} done  requests {s['requests']} errors {s['errors']}  "
        f"hit {pct(s['achieved_hit_rate'])} of bound {pct(s['bound_hit_rate'])}  "
        f"TTFT p50 {ms(s['ttft_p50_s'])} p90 {ms(s['ttft_p90_s'])}"
    )


async def run_with_progress(
    replay: Replay, every_s: float = 5.0, out: Callable[[str], None] = print
) -> dict[str, Any]:
    """`replay.run()` with a progress line every `every_s`; the final snapshot."""
    task = asyncio.ensure_future(replay.run())
    while not task.done():
        await asyncio.wait({task}, timeout=every_s)
        out(progress_line(replay.snapshot()))
    await task
    return replay.snapshot()
