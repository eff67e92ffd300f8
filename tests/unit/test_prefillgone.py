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
    GroupMember,
    Unconfirmed,
    confirmed_end,
    feed_text,
    merge_entries,
    parse_feed_text,
    parse_pending_text,
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
    keyless = prefill_pod()
    keyless["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/name"] = "glm5-prefill"
    assert "LeaderWorkerSet" in confirmed_end(keyless).reason  # type: ignore[union-attr]


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


def test_a_users_configmap_of_the_feeds_name_is_never_written() -> None:
    """Regression (issue 41): the feed was written over any ConfigMap `<name>-prefill-gone`
    (read, then replaced with its resourceVersion), a user's too; the operator writes only
    the one its resource controls."""
    kube = FakeKube()
    users = {"kind": "ConfigMap", "metadata": {"name": "glm5-prefill-gone"}, "data": {"a": "b"}}
    kube._store("ConfigMap", users)
    before = copy.deepcopy(users)
    record = act.record_prefill_end(kube, prefill_pod(uid="u1"), parse_time(T0) or 0.0)  # type: ignore[arg-type]
    assert record.outcome == "not_owned" and "no controller owner reference" in record.detail
    assert kube.objects[("ConfigMap", "glm5-prefill-gone")] == before


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


def group_pod(
    worker: int,
    *,
    uid: str,
    created: str = "2026-12-03T13:00:00Z",
    finished: str = T0,
    ip: str = "10.20.1.1",
    terminated: bool = True,
) -> Any:
    """A pod of a 3-pod LeaderWorkerSet prefill group (worker 0 is the leader)."""
    pod = prefill_pod(uid=uid, ip=ip, terminated=terminated)
    meta = pod["metadata"]
    meta["name"] = "glm5-prefill-0" if worker == 0 else f"glm5-prefill-0-{worker}"
    meta["creationTimestamp"] = created
    meta["labels"].update(
        {
            "leaderworkerset.sigs.k8s.io/name": "glm5-prefill",
            "leaderworkerset.sigs.k8s.io/group-key": "k0",
            "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
        }
    )
    meta["annotations"]["leaderworkerset.sigs.k8s.io/size"] = "3"
    if terminated:
        pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = finished
    return pod


def test_a_group_ends_only_when_its_leader_and_every_worker_of_it_ended() -> None:
    """Regression (issue 13): a LeaderWorkerSet prefill group's workers hold CP ranks that
    write KV too, so its leader's end alone must not free decode rooms; before, groups were
    never recorded and their rooms stayed held. The group is recorded once, when its last
    member ended, at the leader's bootstrap address and finish; a worker of the next
    incarnation (same names, created after the leader ended) does not stand in for one of
    this group; the pending members live in the ConfigMap (an operator restart loses none)."""
    kube = FakeKube()
    now = parse_time(T0) or 0.0
    leader = group_pod(0, uid="L")
    assert isinstance(confirmed_end(leader), GroupMember)
    assert act.record_prefill_end(kube, leader, now + 5).outcome == "pending"  # type: ignore[arg-type]
    w1 = group_pod(1, uid="W1", ip="10.20.1.2", finished="2026-12-03T14:00:03Z")
    assert act.record_prefill_end(kube, w1, now + 5).outcome == "pending"  # type: ignore[arg-type]
    reborn = group_pod(2, uid="N2", created="2026-12-03T14:00:30Z", finished="2026-12-03T14:01:00Z")
    assert act.record_prefill_end(kube, reborn, now + 90).outcome == "pending"  # type: ignore[arg-type]
    data = kube.objects[("ConfigMap", "glm5-prefill-gone")]["data"]
    assert parse_feed_text(data[c.PREFILL_GONE_KEY]) == []
    assert len(parse_pending_text(data[c.PREFILL_GONE_PENDING_KEY])) == 3
    forced = group_pod(2, uid="W2", terminated=False)
    assert act.record_prefill_end(kube, forced, now + 90).outcome == "unconfirmed"  # type: ignore[arg-type]
    w2 = group_pod(2, uid="W2", ip="10.20.1.3", finished="2026-12-03T14:00:07Z")
    record = act.record_prefill_end(kube, w2, now + 90)  # type: ignore[arg-type]
    assert record.outcome == "recorded" and record.detail == "10.20.1.1:8998"
    data = kube.objects[("ConfigMap", "glm5-prefill-gone")]["data"]
    feed = parse_feed(data[c.PREFILL_GONE_KEY])
    assert [(g.host, g.port) for g in feed] == [("10.20.1.1", 8998)]  # decode's own parser
    assert feed[0].finished_at == parse_time(T0)  # the leader's: rooms handshaken before it
    assert [m.uid for m in parse_pending_text(data[c.PREFILL_GONE_PENDING_KEY])] == ["N2"]
