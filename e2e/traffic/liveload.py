"""Bounded coding-agent traffic through each resource's SGLang router, for `make run`'s live view.

Data flow: :class:`LiveLoad` runs its own asyncio loop in one thread. Per resource it keeps
``sessions`` agent conversations (:class:`cas_engine.sim.load.Session`: a shared system prompt,
a repository context, then turns whose prompts extend the previous one) and sends each turn as
a streaming chat request to the resource's router replica, found by ``router_url(name)`` (in
`make run`: ``http://<router pod IP>:8000`` of the router pod the pod runner runs). Every
answer becomes one :class:`Sample` (time, ok, TTFT, garbled) in that resource's
:class:`TrafficWindow`; :meth:`TrafficWindow.summary` turns the last ``window_s`` seconds into
req/s, errors and TTFT percentiles.

Bounded: at most ``sessions`` requests in flight per resource, a pause between turns, a
per-request timeout, and ``max_requests`` in total; :meth:`LiveLoad.stop` ends it within one
request timeout. Ownership: the LiveLoad owns its thread, loop and HTTP session; the windows are
read (under a lock) by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cas_engine.sim.load import BYTES_PER_TOKEN, Session, Workload
from cas_engine.sim.textgen import GARBLE, VOCAB
from e2e.traffic.simload import REPETITION_MARK

# Light prompts (sim tokens of 4 bytes): the 2-core machine runs the whole stack as well.
LIGHT = Workload(sessions=3, system_tokens=800, repo_tokens=1500, tool_tokens=300,
                 max_context=6000, output_tokens=200, max_output=500)  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """One finished request: when, whether it succeeded, TTFT (s) and whether it was garbled."""

    at: float
    ok: bool
    ttft: float | None = None
    garbled: bool = False
    error: str = ""


@dataclass
class TrafficWindow:
    """The recent samples of one resource (monotonic times) plus all-time counters."""

    window_s: float = 30.0
    samples: deque[Sample] = field(default_factory=deque)
    total_ok: int = 0
    total_errors: int = 0
    last_error: str = ""
    started: float = field(default_factory=time.monotonic)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        self.total_ok += sample.ok
        self.total_errors += not sample.ok
        if sample.error:
            self.last_error = sample.error
        cutoff = sample.at - self.window_s
        while self.samples and self.samples[0].at < cutoff:
            self.samples.popleft()

    def summary(self, now: float) -> dict[str, Any]:
        """req/s, errors, garbled and TTFT p50/p90 (s) over the window ending at `now`."""
        recent = [s for s in self.samples if s.at >= now - self.window_s]
        ttfts = sorted(s.ttft for s in recent if s.ttft is not None)
        span = max(1.0, min(self.window_s, now - self.started))  # a young window is shorter
        return {
            "rps": len(recent) / span,
            "ok": sum(s.ok for s in recent),
            "errors": sum(not s.ok for s in recent),
            "garbled": sum(s.garbled for s in recent),
            "ttft_p50": _pct(ttfts, 0.5),
            "ttft_p90": _pct(ttfts, 0.9),
            "total_ok": self.total_ok,
            "total_errors": self.total_errors,
            "last_error": self.last_error,
        }


def system_prompt(seed: int, tokens: int) -> str:
    """About `tokens` sim tokens of code-like words: the tool definitions every session shares."""
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(tokens * BYTES_PER_TOKEN // 5))


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def format_summary(s: dict[str, Any], window_s: float) -> str:
    """One line for the live view."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}ms"

    line = (
        f"{s['rps']:.1f} req/s ({window_s:.0f}s)  ok {s['ok']}  errors {s['errors']}  "
        f"garbled {s['garbled']}  TTFT p50 {ms(s['ttft_p50'])} p90 {ms(s['ttft_p90'])}  "
        f"[total ok {s['total_ok']}, errors {s['total_errors']}]"
    )
    if s["errors"] and s["last_error"]:
        line += f"  last error: {s['last_error'][:60]}"
    return line


async def chat_once(
    http: aiohttp.ClientSession, router: str, body: dict[str, Any]
) -> tuple[Sample, str | None]:
    """One streaming chat request; the sample and the answer text (None on failure)."""
    t0 = time.monotonic()
    ttft: float | None = None
    parts: list[str] = []
    try:
        async with http.post(f"{router}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:120]
                return Sample(time.monotonic(), False, error=f"HTTP {resp.status} {text}"), None
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    kind = str(event["error"].get("type") or event["error"].get("message"))
                    return Sample(time.monotonic(), False, ttft, error=kind), None
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        parts.append(piece)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Sample(time.monotonic(), False, ttft, error=type(exc).__name__), None
    answer = "".join(parts)
    garbled = REPETITION_MARK in answer or any(g in answer for g in GARBLE)
    return Sample(time.monotonic(), True, ttft, garbled), answer


@dataclass
class LiveLoad:
    """See the module docstring. `resources` maps resource name -> served model name."""

    resources: dict[str, str]
    router_url: Callable[[str], str | None]
    workload: Workload = field(default_factory=lambda: LIGHT)
    max_requests: int = 20_000
    pause_s: float = 1.0  # mean think/tool time between two turns of one session (wall)
    timeout_s: float = 60.0
    window_s: float = 30.0
    windows: dict[str, TrafficWindow] = field(default_factory=dict)
    sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _task: asyncio.Task[None] | None = None

    def start(self) -> LiveLoad:
        self.windows = {name: TrafficWindow(self.window_s) for name in self.resources}
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="liveload", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Cancel every session now (requests in flight are abandoned) and join the thread."""
        self._stop.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(10.0)

    def summaries(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return {name: w.summary(now) for name, w in self.windows.items()}

    async def _main(self) -> None:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        if self._stop.is_set():
            return
        with contextlib.suppress(asyncio.CancelledError):
            await self._sessions()

    async def _sessions(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            agents = []
            for r, (name, model) in enumerate(sorted(self.resources.items())):
                wl = Workload(**{**self.workload.__dict__, "model": model, "seed": r})
                system = system_prompt(r, wl.system_tokens)
                agents += [self._agent(http, name, Session(wl, i, system))
                           for i in range(wl.sessions)]  # fmt: skip
            await asyncio.gather(*agents)

    async def _agent(self, http: aiohttp.ClientSession, name: str, session: Session) -> None:
        rng = random.Random(session.sid)
        while not self._stop.is_set() and self.sent < self.max_requests:
            router = await asyncio.to_thread(self.router_url, name)
            if router is None:
                await asyncio.sleep(1.0)
                continue
            self.sent += 1
            body = {**session.request(), "stream": True}
            body.pop("stream_options", None)
            sample, answer = await chat_once(http, router, body)
            with self._lock:
                self.windows[name].add(sample)
            if answer is None:
                session.reset()
            else:
                session.advance(answer)
            await asyncio.sleep(min(5.0, rng.expovariate(1.0 / self.pause_s)))
