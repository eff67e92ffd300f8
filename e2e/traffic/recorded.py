"""Bounded traffic that records every request and the prefill/decode pair that served it, and a
book of which revision each pod IP belonged to: the rollout tests' and `make bench-canary`'s
evidence that no request failed and none was served by a mixed-revision pair.

Data flow: :class:`RecordedLoad` runs its own asyncio loop in one thread; ``workers`` clients
send non-streaming chat requests (``tokens`` generated, ``ignore_eos``), each after a pause of
``pause_s``, to ``url`` until stopped or ``max_requests`` were sent; each answer becomes a
:class:`Served` with the pair the sim decode reports in ``metadata.pd_pair`` (prefill bootstrap
``ip:port``, decode ``ip``).
:class:`PodBook` polls the resource's engine pods (``kubectl``) once a second in its own thread
and keeps, per IP, when it was seen with which revision, so a pair is read back as revisions
even after its pods are gone (an IP reused by another revision within ``SLACK_S`` of a request
reads as unknown, never as a guess).
Ownership: each object owns its thread; `stop` ends it within one request timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cas_operator.api import constants as c
from e2e.fleet.fleetview import labelled_pods

SLACK_S = 5.0  # a pod is taken to hold its IP this long before and after it was seen
PROMPTS = ("refactor the parser", "add a test for the cache", "explain this stack trace")


def closed_unanswered(exc: aiohttp.ClientError) -> bool:
    """Whether the server closed the connection before it answered: a disconnect, or
    aiohttp's "Can not write request body" (the connection closed as the request was sent).
    Not a refused or timed-out connect, nor any other socket error."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and str(exc.strerror or "").startswith(
        "Can not write request body"
    )


@dataclass(frozen=True)
class Served:
    """One request: when it started and ended (monotonic), its status and the PD pair."""

    started: float
    ended: float
    status: int
    prefill: str | None = None  # pod IP
    decode: str | None = None
    error: str = ""
    retried: bool = False  # a kept-alive connection closed under it, sent once more

    @property
    def ok(self) -> bool:
        """Answered 200 with every token asked for (`ignore_eos`: a short answer is a cut)."""
        return self.status == 200 and not self.error


@dataclass
class RecordedLoad:
    url: str
    workers: int = 4
    max_requests: int = 20000
    tokens: int = 160
    timeout_s: float = 120.0
    pause_s: float = 0.2  # each client's think time between requests
    fresh_connections: bool = False  # a new connection per request (no keep-alive)
    host: str | None = None  # the Host header (a fleet's hostname on a shared Gateway)
    served: list[Served] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0

    def start(self) -> RecordedLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Served]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)
        return self.snapshot()

    def snapshot(self) -> list[Served]:
        with self._lock:
            return list(self.served)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(force_close=self.fresh_connections)
        headers = {"Host": self.host} if self.host else None
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=headers
        ) as session:
            await asyncio.gather(*(self._worker(session, w) for w in range(self.workers)))

    async def _worker(self, session: aiohttp.ClientSession, worker: int) -> None:
        turn = 0
        while not self._stop.is_set():
            with self._lock:
                if self._sent >= self.max_requests:
                    return
                self._sent += 1
            turn += 1
            result = await self._one(session, f"{PROMPTS[worker % len(PROMPTS)]} #{turn}")
            with self._lock:
                self.served.append(result)
            await asyncio.sleep(self.pause_s)

    async def _one(self, session: aiohttp.ClientSession, prompt: str) -> Served:
        body = {"model": "sim", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.tokens, "ignore_eos": True}  # fmt: skip
        started = time.monotonic()
        retried = False
        while True:
            try:
                async with session.post(f"{self.url}/v1/chat/completions", json=body) as resp:
                    text = await resp.text()
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A router that retires closes its idle kept-alive connections; the client
                # sends once more on a new one, as the OpenAI SDK does. The close shows as a
                # disconnect, or, when it lands as the client writes, as a request body that
                # could not be written (never read, so nothing was served).
                if not closed_unanswered(exc):
                    error = f"{type(exc).__name__}: {exc}"
                    return Served(started, time.monotonic(), 0, error=error, retried=retried)
                if retried:
                    return Served(started, time.monotonic(), 0, error=f"disconnected: {exc}")
                retried = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                return Served(started, time.monotonic(), 0, error=error, retried=retried)
        ended = time.monotonic()
        if resp.status != 200:
            return Served(started, ended, resp.status, error=text[:200], retried=retried)
        answer = json.loads(text)
        pair = (answer.get("metadata") or {}).get("pd_pair") or {}
        prefill = str(pair.get("prefill", "")).rsplit(":", 1)[0] or None
        got = int((answer.get("usage") or {}).get("completion_tokens", 0))
        cut = "" if got == self.tokens else f"cut: {got} of {self.tokens} tokens"
        return Served(started, ended, 200, prefill, pair.get("decode"), cut, retried)


@dataclass
class PodBook:
    """Pod IP -> [(revision, first seen, last seen)] of one resource's engine pods."""

    kubectl: Callable[..., str]
    namespace: str
    name: str
    seen: dict[str, list[list[Any]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> PodBook:
        self.poll()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.poll()
            except Exception:  # an API hiccup: the next poll catches up
                continue

    def poll(self) -> None:
        selector = f"{c.LABEL_NAME}={self.name},{c.LABEL_APP_NAME}={c.APP_ENGINE}"
        pods = labelled_pods(self.kubectl, self.namespace, selector)
        now = time.monotonic()
        with self._lock:
            for pod in pods:
                ip = (pod.get("status") or {}).get("podIP")
                revision = pod["metadata"]["labels"].get(c.LABEL_REVISION)
                if not ip or not revision:
                    continue
                spans = self.seen.setdefault(ip, [])
                if spans and spans[-1][0] == revision:
                    spans[-1][2] = now
                else:
                    spans.append([revision, now, now])

    def revision(self, ip: str | None, at: float) -> str | None:
        """The revision of the pod that held `ip` at monotonic time `at` (None: unknown)."""
        with self._lock:
            spans = list(self.seen.get(ip or "", []))
        found = {r for r, first, last in spans if first - SLACK_S <= at <= last + SLACK_S}
        return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class PairCheck:
    """The requests of one run by outcome: failed, served by one revision (by revision),
    served by a mixed pair, or by a pair whose revision could not be read."""

    failed: list[Served]
    by_revision: dict[str, int]
    mixed: list[tuple[Served, str | None, str | None]]
    unknown: list[Served]


def check_pairs(served: list[Served], book: PodBook) -> PairCheck:
    by_revision: dict[str, int] = {}
    mixed, unknown, failed = [], [], []
    for s in served:
        if not s.ok:
            failed.append(s)
            continue
        prefill, decode = book.revision(s.prefill, s.started), book.revision(s.decode, s.ended)
        if prefill is None or decode is None:
            unknown.append(s)
        elif prefill != decode:
            mixed.append((s, prefill, decode))
        else:
            by_revision[prefill] = by_revision.get(prefill, 0) + 1
    return PairCheck(failed, by_revision, mixed, unknown)
