"""The operator's record of prefill pods that are gone for good, as a decode rank reads it.

Data flow: the operator (``cas_operator/prefillgone``) keeps, per CodingAgentServing, a
ConfigMap whose key :data:`FEED_KEY` lists prefill pods whose end the kubelet confirmed (every
container reported terminated before the pod object went away; a force-deleted pod is never
listed). The kubelet projects it into each decode pod; the launcher's
``--cas-prefill-gone-file`` names the file. :class:`GoneFeed` polls it from a thread of the
decode scheduler process and hands each entry it has not seen to a callback (the strict-reclaim
patch queues it and applies it on the scheduler thread).

What an entry proves: the prefill process that served ``bootstrap`` until ``finished_at`` (the
kubelet's clock) can write no more. A replacement pod that reuses the address starts after the
old one's sandbox is gone, so a room whose bootstrap completed (decode's clock) before
``finished_at - clock_skew_s`` was written by the gone pod or an earlier one, never by the
replacement (see :mod:`cas_engine.sglang.reclaim`).

Wire format (version 1; the operator's writer is checked against :func:`parse_feed` by a
contract test)::

    {"version": 1, "prefills": [{"bootstrap": "10.0.0.5:8998", "finishedAt":
     "2026-12-03T14:00:00Z", "pod": "ns/name", "uid": "..."}]}

Ownership: the feed owns only its file reads and the set of entries it delivered; it never
touches KV state.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

FEED_VERSION = 1
FEED_KEY = "prefills.json"
POLL_INTERVAL_S = 2.0


class GoneFeedError(ValueError):
    """The feed file is not a version-1 feed; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class GonePrefill:
    """One prefill pod that ended: its bootstrap address and when its containers finished."""

    host: str  # normalised (IP addresses in their canonical form)
    port: int
    finished_at: float  # seconds since the epoch
    pod: str = ""
    uid: str = ""

    @property
    def key(self) -> tuple[str, int, float, str]:
        return (self.host, self.port, self.finished_at, self.uid)


def normalise_host(host: str) -> str:
    """``host`` without IPv6 brackets, IP addresses canonical (``::0001`` -> ``::1``)."""
    bare = host.strip().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare.lower()


def split_host_port(addr: str) -> tuple[str, int]:
    """``"10.0.0.5:8998"`` or ``"[fd00::5]:8998"`` -> (normalised host, port)."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GoneFeedError(f"bootstrap address {addr!r} is not host:port")
    if ":" in host and not host.startswith("["):
        raise GoneFeedError(f"bootstrap address {addr!r}: an IPv6 host needs brackets")
    return normalise_host(host), int(port)


def _timestamp(raw: object, where: str) -> float:
    if not isinstance(raw, str):
        raise GoneFeedError(f"{where}.finishedAt must be an RFC 3339 string")
    try:
        stamp = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError as exc:
        raise GoneFeedError(f"{where}.finishedAt {raw!r}: {exc}") from exc
    if stamp.tzinfo is None:
        raise GoneFeedError(f"{where}.finishedAt {raw!r} has no time zone")
    return stamp.timestamp()


def parse_feed(text: str) -> list[GonePrefill]:
    """Entries of a version-1 feed; an empty file is an empty feed."""
    if not text.strip():
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GoneFeedError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("version") != FEED_VERSION:
        raise GoneFeedError(f"expected an object with version {FEED_VERSION}")
    entries = doc.get("prefills", [])
    if not isinstance(entries, list):
        raise GoneFeedError("prefills must be a list")
    out: list[GonePrefill] = []
    for i, entry in enumerate(entries):
        where = f"prefills[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("bootstrap"), str):
            raise GoneFeedError(f"{where} needs a bootstrap host:port string")
        host, port = split_host_port(entry["bootstrap"])
        finished = _timestamp(entry.get("finishedAt"), where)
        out.append(
            GonePrefill(host, port, finished, str(entry.get("pod", "")), str(entry.get("uid", "")))
        )
    return out


class GoneFeedMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.entries = Gauge(
            "cas_kv_prefill_gone_entries",
            "Prefill pods the operator confirmed gone, as last read from the feed file",
            registry=registry,
        )
        self.errors = Counter(
            "cas_kv_prefill_gone_feed_errors",
            "Reads of the prefill-gone feed file that failed (unreadable or malformed)",
            registry=registry,
        )


class GoneFeed:
    """Polls ``path`` and calls ``on_gone`` once per new entry (from its own thread)."""

    def __init__(
        self,
        path: Path,
        on_gone: Callable[[GonePrefill], None],
        *,
        metrics: GoneFeedMetrics | None = None,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.path = path
        self.on_gone = on_gone
        self.metrics = metrics
        self.interval_s = interval_s
        self._seen: set[tuple[str, int, float, str]] = set()
        self._last_text: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int:
        """Read the file once; returns how many new entries were delivered."""
        try:
            text = self.path.read_text() if self.path.exists() else ""
        except OSError as exc:
            self._error(f"cannot read {self.path}: {exc}")
            return 0
        if text == self._last_text:
            return 0
        try:
            entries = parse_feed(text)
        except GoneFeedError as exc:
            self._error(f"{self.path}: {exc}")
            return 0
        self._last_text = text
        if self.metrics is not None:
            self.metrics.entries.set(len(entries))
        new = [e for e in entries if e.key not in self._seen]
        for entry in new:
            self._seen.add(entry.key)
            self.on_gone(entry)
        self._seen &= {e.key for e in entries}  # the operator prunes old entries; so do we
        return len(new)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="cas-prefill-gone", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # a callback bug must not end the feed silently
                log.exception("prefill-gone feed: delivering an entry failed")
            self._stop.wait(self.interval_s)

    def _error(self, message: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.inc()
        log.warning("prefill-gone feed: %s (entries so far are kept)", message)
