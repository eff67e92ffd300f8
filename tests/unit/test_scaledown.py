"""The scale-down loop: which instances go and when (pure), and its act step over in-memory
pods (the real ReplicaSet controller removing exactly the released pod is in e2e/tests)."""

from __future__ import annotations

from typing import Any

import pytest

from cas_operator.anomaly.drain import (
    ANNOTATION_DRAIN_STATE,
    ANNOTATION_DRAINING_SINCE,
    STATE_RELEASED,
    STATE_RETIRING,
    DrainPolicy,
    next_step,
)
from cas_operator.api import constants as c
from cas_operator.api.models import GuardAction
from cas_operator.observe.types import PodSignals
from cas_operator.scaledown.act import other_revisions, scale_down_tick, work_of
from cas_operator.scaledown.decide import (
    Instance,
    PoolFloor,
    RetirePolicy,
    RevisionLoad,
    replicas_to_apply,
    retire_step,
)
from cas_operator.types import rfc3339
from tests.fakes import MemoryPods

T0 = 1_800_000_000.0
POLICY = RetirePolicy(min_wait_seconds=15, max_wait_seconds=600)


def test_a_deployment_pool_retires_its_least_busy_instance() -> None:
    """Regression: lowering replicas let the ReplicaSet remove a pod running requests."""
    pool = [Instance("a", 5), Instance("b", 0), Instance("c", 2), Instance("d", None)]
    step = retire_step(3, pool, T0, POLICY)
    assert step.mark == ("b",) and step.keep == 4 and not step.release
    assert retire_step(2, pool, T0, POLICY).mark == ("b", "c")  # unknown work goes last


def test_an_instance_not_ready_goes_first_and_is_released_without_a_reading() -> None:
    pool = [Instance("a", 0), Instance("starting", None, ready=False)]
    assert retire_step(1, pool, T0, POLICY).mark == ("starting",)
    marked = Instance("starting", None, ready=False, state=STATE_RETIRING, retiring_since=T0)
    assert retire_step(1, [pool[0], marked], T0 + 15, POLICY).release == ("starting",)


def test_a_choice_in_progress_is_kept_when_another_instance_becomes_idler() -> None:
    pool = [Instance("a", 0), Instance("b", 3, state=STATE_RETIRING, retiring_since=T0)]
    step = retire_step(1, pool, T0 + 5, POLICY)
    assert step.mark == () and step.restore == () and step.keep == 2


@pytest.mark.parametrize(
    ("work", "waited", "released"),
    [
        (0, 5, False),  # a reading from before the marks may say 0: wait min_wait_seconds
        (0, 15, True),
        (2, 100, False),  # requests still running
        (None, 10_000, False),  # work unknown: never on a timer alone
        (2, 600, True),  # the drain grace is over; its preStop still lets it finish
    ],
)
def test_a_retiring_instance_is_released_once_idle(
    work: float | None, waited: float, released: bool
) -> None:
    pool = [Instance("a", 0), Instance("b", work, state=STATE_RETIRING, retiring_since=T0)]
    step = retire_step(1, pool, T0 + waited, POLICY)
    assert (step.release == ("b",)) is released
    assert step.keep == (1 if released else 2)


def test_a_raised_count_puts_retiring_instances_back_in_rotation() -> None:
    pool = [
        Instance("a", 0),
        Instance("b", 0, state=STATE_RETIRING, retiring_since=T0),
        Instance("c", 0, state=STATE_RELEASED, retiring_since=T0),
    ]
    assert retire_step(3, pool, T0 + 20, POLICY).restore == ("b", "c")
    step = retire_step(2, pool, T0 + 20, POLICY)  # one still goes: the released one
    assert step.restore == ("b",) and step.keep == 2


def test_a_leaderworkerset_pool_retires_its_highest_groups_whatever_their_work() -> None:
    """Its leader StatefulSet removes the highest indices: those are the ones to drain."""
    pool = [Instance(f"g{i}", work, group_index=i) for i, work in enumerate([0, 0, 9])]
    assert retire_step(2, pool, T0, POLICY).mark == ("g2",)


def test_a_pod_drained_by_the_anomaly_loop_is_not_chosen() -> None:
    pool = [Instance("a", 4), Instance("bad", 0, drained_by_anomaly=True)]
    assert retire_step(1, pool, T0, POLICY).mark == ("a",)


@pytest.mark.parametrize(
    ("desired", "observed", "floor", "applied"),
    [
        (4, 2, None, 4),  # up: at once
        (2, 4, None, 4),  # down: nothing released yet
        (2, 4, (3, 4), 3),
        (2, 4, (0, 4), 2),  # never below the desired count
        (2, 3, (3, 4), 3),  # a finding from before a scale-up does not raise it
        (2, 3, (3, 3), 3),  # after the released pod went: no second cut
        # Regression (bench-lifecycle): a finding from before a scale-up (it saw 1 instance)
        # lowered the workload at once when the count dropped again, and the ReplicaSet
        # removed a pod that was never retired.
        (1, 2, (1, 1), 2),
    ],
)
def test_replicas_to_apply(
    desired: int, observed: int, floor: tuple[int, int] | None, applied: int
) -> None:
    found = PoolFloor("r1", "decode", *floor) if floor else None
    assert replicas_to_apply(desired, observed, found) == applied


def test_kv_transfers_in_flight_count_as_work() -> None:
    """A prefill pod whose KV a decode has not taken yet is not idle (SGLang's PD queues)."""
    assert work_of(PodSignals(running=0, queued=0, kv_transfers=1)) == 1
    assert work_of(PodSignals(running=0, error="scrape failed")) is None


def engine_pod(name: str, role: str = "decode", revision: str = "r1") -> dict[str, Any]:
    labels = {
        c.LABEL_NAME: "demo",
        c.LABEL_APP_NAME: c.APP_ENGINE,
        c.LABEL_ROLE: role,
        c.LABEL_REVISION: revision,
        c.LABEL_SERVING: "true",
    }
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels, "annotations": {}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


STATUS = {"revision": "r1", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def test_the_tick_takes_the_idlest_pod_out_of_rotation_then_releases_it() -> None:
    pods = MemoryPods([engine_pod("d0"), engine_pod("d1"), engine_pod("p0", "prefill")])
    signals = {"d0": PodSignals(running=3), "d1": PodSignals(running=0), "p0": None}

    def tick(now: float) -> Any:
        listed = [pods.pod(n) for n in ("d0", "d1", "p0")]
        return scale_down_tick(pods, listed, signals, STATUS, 600, now)

    first = tick(T0)
    d1 = pods.pod("d1")["metadata"]
    assert (
        c.LABEL_SERVING not in d1["labels"]
        and c.LABEL_SERVING in pods.pod("d0")["metadata"]["labels"]
    )
    assert d1["annotations"][ANNOTATION_DRAIN_STATE] == STATE_RETIRING
    assert {(f.role, f.keep) for f in first.floors} == {("decode", 2), ("prefill", 1)}
    assert [e[1] for e in first.events] == ["PodRetiring"]
    # The anomaly drain leaves a scale-down's pod alone (it would evict it, and the
    # ReplicaSet would make a new one).
    assert next_step(pods.pod("d1"), 0, GuardAction.REPLACE, T0 + 60, DrainPolicy()) == "none"
    released = tick(T0 + 20)
    assert d1["annotations"][c.ANNOTATION_POD_DELETION_COST] == c.LOWEST_DELETION_COST
    assert {(f.role, f.keep) for f in released.floors} == {("decode", 1), ("prefill", 1)}
    restored = scale_down_tick(
        pods,
        [pods.pod("d0"), pods.pod("d1")],
        signals,
        {**STATUS, "decode": {"replicas": 2}},
        600,
        T0 + 30,
    )
    assert [e[1] for e in restored.events] == ["PodRestored"]
    assert d1["labels"][c.LABEL_SERVING] == "true"
    assert ANNOTATION_DRAINING_SINCE not in d1["annotations"]
    assert c.ANNOTATION_POD_DELETION_COST not in d1["annotations"]


def test_pods_of_an_older_revision_are_left_to_the_retire_path() -> None:
    pods = MemoryPods([engine_pod("old0", revision="r0"), engine_pod("old1", revision="r0")])
    listed = [pods.pod("old0"), pods.pod("old1")]
    result = scale_down_tick(pods, listed, {}, STATUS, 600, T0)
    assert result.floors == () and pods.calls == []


def test_marks_are_timestamped_for_the_anomaly_loop_to_deregister() -> None:
    pods = MemoryPods([engine_pod("d0"), engine_pod("d1")])
    scale_down_tick(pods, [pods.pod("d0"), pods.pod("d1")], {}, STATUS, 600, T0)
    marked = [
        p
        for p in ("d0", "d1")
        if ANNOTATION_DRAINING_SINCE in pods.pod(p)["metadata"]["annotations"]
    ]
    assert len(marked) == 1
    assert pods.pod(marked[0])["metadata"]["annotations"][ANNOTATION_DRAINING_SINCE] == rfc3339(T0)


def test_an_older_revisions_work_counts_its_ready_instances_only() -> None:
    """Its retire waits for this: a crash-looping old revision (nothing Ready) is idle, one
    Ready instance without a reading makes it unknown."""
    starting = engine_pod("old1", revision="r0")
    starting["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    pods = [engine_pod("old0", revision="r0"), starting, engine_pod("new0")]
    signals = {"old0": PodSignals(running=2, queued=1), "old1": None}
    assert other_revisions(pods, signals, frozenset({"r1"})) == (RevisionLoad("r0", 3.0),)
    assert other_revisions(pods, {}, frozenset({"r1"})) == (RevisionLoad("r0", None),)
    assert other_revisions([starting], {}, frozenset({"r1"})) == (RevisionLoad("r0", 0.0),)
