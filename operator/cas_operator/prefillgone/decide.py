"""The prefill-gone loop's pure half: which ended prefill pods are confirmed, and the feed.

`confirmed_end(pod)` reads the last copy of a deleted prefill pod and returns a `GoneEntry`
(bootstrap address and the time its containers finished) or `Unconfirmed` with the reason.
`merge_entries` folds an entry into the feed (one per pod uid, newest `FEED_CAP`, none older
than `FEED_TTL_S`); `feed_text` / `parse_feed_text` are the wire format decode reads
(cas_engine.kvfence.gone_feed.parse_feed; a contract test holds them together).
No I/O, no clock: the caller passes `now`.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cas_operator.api import constants as c
from cas_operator.types import Manifest, parse_time, rfc3339

FEED_VERSION = 1
FEED_TTL_S = 3600.0  # decode aborts a dead prefill's rooms within minutes; keep an hour
FEED_CAP = 512  # entries (~150 bytes each: far below a ConfigMap's 1 MiB)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


@dataclass(frozen=True)
class GoneEntry:
    """A prefill pod whose end the kubelet confirmed."""

    bootstrap: str  # host:port decode dials (IPv6 bracketed)
    finished_at: str  # RFC 3339: the last of its containers' finishedAt
    pod: str  # namespace/name, for people reading the ConfigMap
    uid: str

    def as_json(self) -> dict[str, str]:
        return {
            "bootstrap": self.bootstrap,
            "finishedAt": self.finished_at,
            "pod": self.pod,
            "uid": self.uid,
        }


@dataclass(frozen=True)
class Unconfirmed:
    """A prefill pod gone without the kubelet's word that nothing of it runs. ``alarm``: it
    may have written KV and may still run (a force delete), worth a Warning event; else it
    never served, or is a kind the loop does not track (a log line is enough)."""

    pod: str
    reason: str
    alarm: bool = False


def _bootstrap(pod: Manifest) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    port = ((pod.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_BOOTSTRAP_PORT)
    if not ip or not str(port or "").isdigit():
        return None
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else str(ip)
    return f"{host}:{int(str(port))}"


def confirmed_end(pod: Manifest) -> GoneEntry | Unconfirmed:
    """Whether this deleted prefill pod's end is confirmed, from its last copy."""
    meta = pod.get("metadata") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    if (meta.get("labels") or {}).get(LWS_NAME_LABEL):
        return Unconfirmed(
            name, "a LeaderWorkerSet group's workers also write KV; groups are not tracked"
        )
    bootstrap = _bootstrap(pod)
    if bootstrap is None:
        return Unconfirmed(name, "no pod IP or bootstrap port: it never served")
    statuses: list[dict[str, Any]] = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses:
        return Unconfirmed(name, "no container status: nothing says its containers stopped")
    finished: list[float] = []
    for status in statuses:
        terminated = (status.get("state") or {}).get("terminated") or {}
        at = parse_time(terminated.get("finishedAt"))
        if at is None:
            return Unconfirmed(
                name,
                f"container {status.get('name')!r} not reported terminated (force-deleted, or "
                "its node is gone): its writes may still land",
                alarm=True,
            )
        finished.append(at)
    return GoneEntry(bootstrap, rfc3339(max(finished)), name, str(meta.get("uid", "")))


def merge_entries(
    entries: Iterable[GoneEntry],
    new: GoneEntry,
    now: float,
    *,
    ttl_s: float = FEED_TTL_S,
    cap: int = FEED_CAP,
) -> list[GoneEntry]:
    """The feed with `new` in it: one entry per pod uid, none older than `ttl_s`, the newest
    `cap`, oldest first."""
    by_uid = {e.uid: e for e in entries}
    by_uid[new.uid] = new
    fresh = [e for e in by_uid.values() if (parse_time(e.finished_at) or 0.0) >= now - ttl_s]
    fresh.sort(key=lambda e: (parse_time(e.finished_at) or 0.0, e.uid))
    return fresh[-cap:]


def feed_text(entries: Iterable[GoneEntry]) -> str:
    """The ConfigMap value decode reads (`c.PREFILL_GONE_KEY`)."""
    doc = {"version": FEED_VERSION, "prefills": [e.as_json() for e in entries]}
    return json.dumps(doc, indent=1, sort_keys=True)


def parse_feed_text(text: str | None) -> list[GoneEntry]:
    """The entries of a feed this operator wrote; [] for none or an unreadable one (a feed
    someone broke is rewritten from the next entry on: decode keeps what it already read)."""
    try:
        doc = json.loads(text or "")
        items = doc["prefills"] if doc.get("version") == FEED_VERSION else []
        return [
            GoneEntry(
                str(i["bootstrap"]), str(i["finishedAt"]), str(i.get("pod", "")), str(i["uid"])
            )
            for i in items
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
