"""Signals from scraping each pod's `/metrics` directly (clusters without Prometheus).

Data flow: every `observe` call scrapes all targets concurrently (bounded thread pool, hard
per-request timeout), parses the text exposition format, and appends one sample of the
counters of interest to that pod's in-memory history. A windowed increase is the sum of
positive steps over the samples inside the window (a drop is a counter reset: the engine
restarted, and the new value counts from zero), so it needs two scrapes of the same pod.
History is keyed by (pod name, pod IP): a replaced pod with the same name starts afresh.
Ownership: one ScrapeSource per operator process; its history is only a rate cache (losing it
costs one window of data, never a wrong decision).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from cas_operator.observe import types as m
from cas_operator.observe.http import FetchError, get
from cas_operator.observe.types import Observation, PodSignals, PodTarget

COUNTER_KEYS = (
    m.CHECKED,
    m.REASON_LOW,
    m.REASON_HIGH,
    m.ABORTED,
    *m.LOAD_COUNTERS,
    *m.REUSE_COUNTERS,
    m.KV_FAILURES,
    m.RESPONSES,
    m.ERRORS_5XX,
    m.REFUSED,
)


@dataclass(frozen=True)
class Scrape:
    """One parsed scrape: counter totals (COUNTER_KEYS) and gauges (types.GAUGES)."""

    at: float
    counters: dict[str, float]
    gauges: dict[str, float]


def parse_exposition(text: str, at: float) -> Scrape:
    """Counters summed across their labels (model_name etc.), trips split by `reason`, TTFT,
    ITL and prompt-reuse histogram buckets split by `le` (types.bucket_key); gauges
    combined across series (quarantine flag: max, KV usage: mean, queues: sum).
    Raises ValueError on malformed text."""
    counters: dict[str, float] = {}
    gauge_values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            value = float(sample.value)
            if math.isnan(value):
                continue
            if sample.name == m.TRIPS:
                key = sample.labels.get("reason", "")
                counters[key] = counters.get(key, 0.0) + value
            elif sample.name in (m.CHECKED, m.ABORTED, *m.LOAD_COUNTERS, *m.REUSE_COUNTERS):
                counters[sample.name] = counters.get(sample.name, 0.0) + value
            elif sample.name in m.KV_FAILURE_COUNTERS:
                counters[m.KV_FAILURES] = counters.get(m.KV_FAILURES, 0.0) + value
            elif sample.name == m.ROUTER_RESPONSES:
                counters[m.RESPONSES] = counters.get(m.RESPONSES, 0.0) + value
                code = str(sample.labels.get("status_code", ""))
                if code.startswith("5"):
                    counters[m.ERRORS_5XX] = counters.get(m.ERRORS_5XX, 0.0) + value
                elif code == "429":
                    counters[m.REFUSED] = counters.get(m.REFUSED, 0.0) + value
            elif sample.name in m.HISTOGRAMS:
                key = m.bucket_key(sample.labels.get("le", ""), sample.name)
                counters[key] = counters.get(key, 0.0) + value
            elif sample.name in m.GAUGES:
                gauge_values.setdefault(sample.name, []).append(value)
            elif sample.name in m.KV_TRANSFER_QUEUES:
                gauge_values.setdefault(m.KV_TRANSFERS, []).append(value)
    gauges = {}
    for name, values in gauge_values.items():
        if name == m.UNHEALTHY:
            gauges[name] = max(values)
        elif name == m.TOKEN_USAGE:
            gauges[name] = sum(values) / len(values)
        else:
            gauges[name] = sum(values)
    return Scrape(at, counters, gauges)


def windowed_increase(samples: Sequence[Scrape], key: str, window: float) -> float | None:
    """Increase of counter `key` over the samples within `window` of the newest; None when no
    sample carries it or there is only one sample. Resets count from zero (Prometheus'
    `increase` rule), and so does a series that first appears in the window: labelled counters
    are created by their first event (a router's first 429, a gate's first trip), so a scrape of
    the same process without it read zero."""
    if not samples:
        return None
    start = samples[-1].at - window
    inside = [s for s in samples if s.at >= start]
    if len(inside) < 2 or not any(key in s.counters for s in inside):
        return None
    total = 0.0
    for a, b in itertools.pairwise(inside):
        if key not in b.counters:
            continue
        va, vb = a.counters.get(key, 0.0), b.counters[key]
        total += vb - va if vb >= va else vb
    return total


@dataclass
class _History:
    ip: str
    samples: deque[Scrape] = field(default_factory=lambda: deque(maxlen=512))
    keep_seconds: float = 0.0


@dataclass
class ScrapeSource:
    """Scrapes `http://<pod ip>:<port><path>`; keeps per-pod history for windowed increases."""

    timeout_seconds: float = 2.0
    path: str = "/metrics"
    max_workers: int = 16
    max_answer_bytes: int = 8 * 1024 * 1024
    clock: Callable[[], float] = time.monotonic
    _history: dict[str, _History] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, targets: Sequence[PodTarget], window_seconds: float) -> Observation:
        """Scrape every target now; pods without an IP or whose scrape fails get an error."""
        now = self.clock()
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(targets)))) as pool:
            scraped = list(pool.map(lambda t: self._scrape(t, now), targets))
        out = Observation()
        with self._lock:
            live = {t.name for t in targets}
            for name in [n for n in self._history if n not in live]:
                del self._history[name]  # pods that went away
            for target, result in zip(targets, scraped, strict=True):
                out.signals[target.name] = self._record(target, result, window_seconds)
        if targets and all(s.error is not None for s in out.signals.values()):
            out.error = f"no pod could be scraped ({next(iter(out.signals.values())).error})"
        return out

    def _scrape(self, target: PodTarget, now: float) -> Scrape | str:
        if not target.ip:
            return "pod has no IP yet"
        url = f"http://{target.ip}:{target.port}{self.path}"
        try:
            body = get(url, None, self.timeout_seconds, self.max_answer_bytes)
            return parse_exposition(body.decode("utf-8", errors="replace"), now)
        except FetchError as exc:
            return f"scrape failed: {exc}"
        except ValueError as exc:
            return f"unparsable metrics from {url}: {exc}"

    def _record(self, target: PodTarget, result: Scrape | str, window: float) -> PodSignals:
        """Append a good scrape to the pod's history and derive its windowed signals."""
        if isinstance(result, str):
            return PodSignals(error=result)
        hist = self._history.get(target.name)
        if hist is None or hist.ip != target.ip:
            hist = self._history[target.name] = _History(ip=target.ip or "")
        hist.samples.append(result)
        # Kept for the longest window any caller asks for (the anomaly loop's and a rollout
        # analysis' windows differ): trimming to the shorter one would blind the longer.
        hist.keep_seconds = max(hist.keep_seconds, 2 * window)
        while hist.samples and hist.samples[0].at < result.at - hist.keep_seconds:
            hist.samples.popleft()
        counters = {}
        buckets = [k for k in result.counters if k.startswith(m.HISTOGRAMS)]
        for key in (*COUNTER_KEYS, *buckets):
            inc = windowed_increase(hist.samples, key, window)
            if inc is not None:
                counters[key] = inc
        recent = windowed_increase(hist.samples, m.REQUESTS, m.rate_window(window))
        if recent is not None:
            counters[m.RECENT_REQUESTS] = recent
        has_guard = m.CHECKED in counters
        return m.signals_from(counters, result.gauges, has_guard=has_guard)
