"""The prefill-gone loop (cas_operator/prefillgone): which deleted prefill pods count as ended,
the feed's bounds, its wire contract with decode's reader, and the write path's races."""

from __future__ import annotations

import copy
from typing import Any

from cas_engine.kvfence.gone_feed import parse_feed
from cas_operator.api import constants as c
from cas_operator.prefillgone import act
from cas_operator.prefillgone.decide import (
    FEED_CAP,
    GoneEntry,
    Unconfirmed,
    confirmed_end,
    feed_text,
    merge_entries,
    parse_feed_text,
)
from cas_operator.types import parse_time

T0 = "2026-12-03T14:00:00Z"


def prefill_pod(*, terminated: bool = True, ip: str = "10.20.0.7", uid: str = "u1") -> Any:
    state: dict[str, Any] = (
        {"terminated": {"exitCode": 0, "finishedAt": T0}}
        if terminated
        else {"running": {"startedAt": "2026-12-03T13:00:00Z"}}
    )
    return {
        "metadata": {
            "name": "glm5-prefill-abc",
            "namespace": "team",
            "uid": uid,
            "labels": {c.LABEL_NAME: "glm5", c.LABEL_ROLE: c.ROLE_PREFILL},
            "annotations": {c.ANNOTATION_BOOTSTRAP_PORT: "8998"},
        },
        "status": {"podIP": ip, "containerStatuses": [{"name": "engine", "state": state}]},
    }


def test_only_a_kubelet_reported_end_is_confirmed() -> None:
    """Regression guard: a force-deleted prefill (containers not reported terminated) may still
    write into decode KV; listing it would let decode reuse KV under a live write."""
    entry = confirmed_end(prefill_pod())
    assert entry == GoneEntry("10.20.0.7:8998", T0, "team/glm5-prefill-abc", "u1")
    forced = confirmed_end(prefill_pod(terminated=False))
    assert isinstance(forced, Unconfirmed) and "force-deleted" in forced.reason
    assert confirmed_end(prefill_pod(ip="fd00::7")).bootstrap == "[fd00::7]:8998"  # type: ignore[union-attr]
    never = prefill_pod()
    never["status"] = {}
    assert isinstance(confirmed_end(never), Unconfirmed)
    group = prefill_pod()
    group["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/name"] = "glm5-prefill"
    assert "LeaderWorkerSet" in confirmed_end(group).reason  # type: ignore[union-attr]


def test_feed_keeps_one_entry_per_pod_an_hour_and_at_most_the_cap() -> None:
    now = parse_time(T0) or 0.0
    old = GoneEntry("10.0.0.1:8998", "2026-12-03T12:00:00Z", "team/a", "a")
    first = GoneEntry("10.0.0.2:8998", T0, "team/b", "b")
    merged = merge_entries([old], first, now)
    assert merged == [first]  # two hours old: pruned
    again = merge_entries(merged, first, now)
    assert again == [first]
    many = [GoneEntry(f"10.0.{i // 250}.{i % 250}:8998", T0, "p", f"u{i}") for i in range(600)]
    assert len(merge_entries(many, first, now)) == FEED_CAP


def test_feed_text_is_what_decode_parses() -> None:
    """The wire contract: every entry the operator writes is read back by decode's parser with
    the same address and time (cas_engine.kvfence.gone_feed)."""
    entries = [
        GoneEntry("10.20.0.7:8998", T0, "team/p0", "u0"),
        GoneEntry("[fd00::7]:8998", "2026-12-03T14:00:05Z", "team/p1", "u1"),
    ]
    got = parse_feed(feed_text(entries))
    assert [(g.host, g.port, g.uid) for g in got] == [
        ("10.20.0.7", 8998, "u0"),
        ("fd00::7", 8998, "u1"),
    ]
    assert got[0].finished_at == parse_time(T0)
    assert parse_feed_text(feed_text(entries)) == entries
    assert parse_feed_text("{not json") == [] and parse_feed_text(None) == []


class FakeKube:
    """The Kube seam: a ConfigMap store with resourceVersions, and a racing writer."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[str, str]] = []
        self.race_once = False
        self.version = 0

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == c.KIND:
            return {"metadata": {"name": name, "namespace": namespace, "uid": "cas-uid"}}
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj else None

    def _store(self, kind: str, manifest: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        manifest["metadata"]["resourceVersion"] = str(self.version)
        self.objects[(kind, manifest["metadata"]["name"])] = manifest
        return manifest

    def create(self, kind: str, namespace: str, manifest: dict[str, Any]) -> Any:
        if (kind, manifest["metadata"]["name"]) in self.objects:
            return None
        return self._store(kind, copy.deepcopy(manifest))

    def replace(self, kind: str, namespace: str, name: str, manifest: dict[str, Any]) -> Any:
        if self.race_once:  # another prefill's end lands between our read and write
            self.race_once = False
            other = copy.deepcopy(self.objects[(kind, name)])
            feed = parse_feed_text(other["data"][c.PREFILL_GONE_KEY])
            racer = GoneEntry("10.0.0.9:8998", T0, "team/racer", "racer")
            other["data"][c.PREFILL_GONE_KEY] = feed_text([*feed, racer])
            self._store(kind, other)
        current = self.objects[(kind, name)]["metadata"]["resourceVersion"]
        if manifest["metadata"].get("resourceVersion") != current:
            return None
        return self._store(kind, copy.deepcopy(manifest))

    def post_event(self, obj: Any, event_type: str, reason: str, message: str) -> None:
        self.events.append((reason, message))


def test_record_creates_the_owned_configmap_and_survives_a_concurrent_end() -> None:
    """Regression guard: two prefill pods ending at once must both reach the feed (a blind
    write would drop one, and decode would hold that pod's rooms forever)."""
    kube = FakeKube()
    now = parse_time(T0) or 0.0
    assert act.record_prefill_end(kube, prefill_pod(uid="u1"), now).outcome == "recorded"  # type: ignore[arg-type]
    cm = kube.objects[("ConfigMap", "glm5-prefill-gone")]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "cas-uid"
    kube.race_once = True
    second = prefill_pod(uid="u2", ip="10.20.0.8")
    assert act.record_prefill_end(kube, second, now).outcome == "recorded"  # type: ignore[arg-type]
    feed = parse_feed_text(
        kube.objects[("ConfigMap", "glm5-prefill-gone")]["data"][c.PREFILL_GONE_KEY]
    )
    assert sorted(e.uid for e in feed) == ["racer", "u1", "u2"]


def test_an_unconfirmed_end_is_a_warning_event_and_not_recorded() -> None:
    kube = FakeKube()
    record = act.record_prefill_end(kube, prefill_pod(terminated=False), 0.0)  # type: ignore[arg-type]
    assert record.outcome == "unconfirmed"
    assert kube.objects == {}
    assert kube.events and kube.events[0][0] == act.REASON_UNCONFIRMED
    pending = prefill_pod()
    pending["status"] = {}  # deleted before it ever ran (a scale-down of a pending pod)
    assert act.record_prefill_end(kube, pending, 0.0).outcome == "unconfirmed"  # type: ignore[arg-type]
    assert len(kube.events) == 1  # no Warning for it
