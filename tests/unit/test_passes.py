"""The per-resource pass queue (`passes.Passes`) and the handlers that feed it, no cluster.

Each test builds its own `Passes` (no module globals to patch) and replaces the pass body or
the refresh queue with recorders; what is tested is the protocol: a non-waiting pass never
blocks behind a running one, and the running one then queues exactly one more refresh, so no
child change is left unobserved; and a pass writes a condition with its evidence in one patch.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest

from cas_operator import handlers
from cas_operator.api import constants as c
from cas_operator.passes import INDEX_SETTLE_SECONDS, Passes
from cas_operator.reconcile.core import Measured, Outcome
from tests.fakes import MemoryKube

META = {"uid": "u1", "name": "demo", "namespace": "ns"}


@dataclass
class Recorder:
    ran: list[str] = field(default_factory=list)
    queued: list[tuple[str, str]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def body(self, meta: Any, spec: Any, status: Any, *, trigger: str, **_: Any) -> Any:
        self.ran.append(trigger)
        if trigger == "spec":  # a slow create
            self.started.set()
            self.release.wait(5)
        return Outcome(status={})


def no_kube() -> Any:
    raise AssertionError("this test talks to no API server")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[Passes, Recorder]:
    rec, passes = Recorder(), Passes(no_kube)
    monkeypatch.setattr(passes, "locked_pass", rec.body)
    monkeypatch.setattr(passes, "queue", rec.queued.append)
    return passes, rec


def test_a_refresh_never_waits_behind_a_running_pass_and_is_not_lost(
    recorded: tuple[Passes, Recorder],
) -> None:
    """Regression: refresh workers blocked on owner locks behind 3 s creates left resources
    NotReady for minutes at N=200; skipping must still leave one refresh queued."""
    passes, rec = recorded
    slow = threading.Thread(
        target=passes.run, args=(META, {}, {}), kwargs={"full": True, "trigger": "spec"}
    )
    slow.start()
    assert rec.started.wait(5)
    for _ in range(3):  # several child events while the create runs
        assert passes.run(META, {}, {}, full=False, trigger="child", wait=False) is None
    assert rec.queued == []
    rec.release.set()
    slow.join(5)
    assert rec.ran == ["spec"] and rec.queued == [("ns", "demo")]


def test_a_free_owner_runs_at_once_and_queues_nothing(recorded: tuple[Passes, Recorder]) -> None:
    passes, rec = recorded
    out = passes.run(META, {}, {}, full=False, trigger="child", wait=False)
    assert out is not None and rec.ran == ["child"] and rec.queued == []


READY = {"observedGeneration": 3, "conditions": [{"type": "Ready", "status": "True"}]}


@pytest.mark.parametrize(
    ("reason", "status", "full"),
    [
        ("resume", READY, False),  # settled: light pass, full re-apply staggered
        ("resume", {**READY, "observedGeneration": 2}, True),  # spec changed while down
        ("resume", {"observedGeneration": 3, "conditions": []}, True),  # killed mid-create
        ("create", READY, True),
        ("update", READY, True),
    ],
)
def test_a_restart_does_not_reapply_every_settled_resource_at_once(
    monkeypatch: pytest.MonkeyPatch, reason: str, status: dict[str, Any], full: bool
) -> None:
    """Regression guard: on operator start kopf resumes every resource; a full apply each
    (12 server-side applies) at N=200 is 2,400 requests in one burst."""
    calls: list[bool] = []

    def fake_pass(*args: Any, full: bool, **kwargs: Any) -> Any:
        calls.append(full)
        return Outcome(status={})

    passes = Passes(no_kube)
    monkeypatch.setattr(passes, "run", fake_pass)
    monkeypatch.setattr(handlers, "PASSES", passes)
    handlers.on_spec(
        body={},
        meta={**META, "generation": 3},
        spec={},
        status=status,
        logger=None,
        reason=reason,  # type: ignore[arg-type]
        deployment_index={},
        lws_index={},
    )
    assert calls == [full]
    if not full:  # its full re-apply falls due somewhere in the next period, not now
        last = passes.last_full_apply["u1"]
        assert time.monotonic() - handlers.FULL_APPLY_SECONDS <= last <= time.monotonic()


@pytest.mark.parametrize(("retry", "delay"), [(0, 2.0), (2, 8.0), (9, 30.0)])
def test_a_spec_pass_with_failed_applies_is_retried_soon_with_backoff(
    monkeypatch: pytest.MonkeyPatch, retry: int, delay: float
) -> None:
    """Regression (issue 17): under OwnerReferencesPermissionEnforcement a fleet applied right
    after its CRD was installed had every child refused for a while (the API server's
    admission had not mapped the new kind); the create handler returned, so nothing retried
    before the 30 s timer and the fleet sat without children for over a minute."""
    passes = Passes(no_kube)
    monkeypatch.setattr(passes, "run", lambda *a, **k: Outcome(status={}, failed=3))
    monkeypatch.setattr(handlers, "PASSES", passes)
    with pytest.raises(kopf.TemporaryError) as raised:
        handlers.on_spec(
            body={}, meta={**META, "generation": 1}, spec={}, status={}, logger=None,
            reason="create",  # type: ignore[arg-type]
            deployment_index={}, lws_index={}, retry=retry,
        )  # fmt: skip
    assert raised.value.delay == delay and "3 children" in str(raised.value)


def test_missing_workloads_are_created_only_by_spec_passes_after_a_delete_or_settling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards the index-lag rule: before this process's create/resume pass, and right after
    our own apply, a workload absent from the watch-fed index is in flight, not gone
    (bench-operator N=200: a refresh queued by the fleet tick ran before the create handler
    and both created the Deployments: 2.6 extra applies per resource). After a DELETED event,
    or once the index had time, a refresh re-creates it; spec and resume passes always do."""
    seen: list[bool] = []

    def fake_reconcile(*_: Any, apply_missing: bool, **__: Any) -> Any:
        seen.append(apply_missing)
        return Outcome(
            status={"conditions": [{"type": c.COND_DEGRADED, "status": "False"}]}, applied=1
        )

    monkeypatch.setattr("cas_operator.passes.reconcile", fake_reconcile)
    kube = MemoryKube()
    passes = Passes(lambda: kube)  # type: ignore[arg-type,return-value]
    monkeypatch.setattr(passes, "queue", lambda key: None)
    meta = {**META, "generation": 1}

    def run(trigger: str) -> None:
        passes.locked_pass(meta, {}, {}, full=trigger == "spec", trigger=trigger, observe=list)

    run("child")  # before the create handler ran in this process
    run("spec")
    run("child")  # the create just applied: the index may lag
    monkeypatch.setattr(handlers, "PASSES", passes)
    asyncio.run(
        handlers.on_child_event(
            labels={c.LABEL_NAME: "demo"},
            namespace="ns",  # type: ignore[arg-type]
            type="DELETED",
        )
    )
    run("child")
    run("timer")  # the DELETED mark was used up
    passes.applied_at["u1"] -= INDEX_SETTLE_SECONDS
    run("timer")
    run("resume")
    assert seen == [False, True, False, True, False, True, True]


def test_a_pass_writes_the_fleet_ticks_finding_with_its_condition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (a fresh machine's make test: Degraded said FleetWideAnomaly while
    status.anomaly had no fleetWide). The fleet tick writes no status of its own; the pass
    that folds its finding into the conditions writes the finding in the same patch, and
    writes nothing when neither changed."""
    anomaly = {"fleetWide": "most decode pods elevated", "signalUnavailable": None}
    measured = Measured(sections={"anomaly": anomaly, "draining": []})
    kube = MemoryKube()
    passes = Passes(lambda: kube, measured_for=lambda uid, status: measured)  # type: ignore[arg-type,return-value]
    spec = {"model": {"name": "glm-5"}}

    passes.locked_pass({**META, "generation": 1}, spec, {}, full=True, trigger="spec", observe=list)
    (patch,) = kube.status_patches
    degraded = next(cd for cd in patch["conditions"] if cd["type"] == c.COND_DEGRADED)
    assert degraded["reason"] == c.REASON_FLEET_ANOMALY
    assert patch["anomaly"]["fleetWide"] == "most decode pods elevated"
    passes.locked_pass(
        {**META, "generation": 1}, spec, patch, full=True, trigger="timer", observe=list
    )
    assert len(kube.status_patches) == 1  # unchanged: no second write


def test_index_functions_never_occupy_kopfs_executor() -> None:
    """Regression (bench-operator N=200): kopf runs sync index functions and timers on the
    executor its sync create handlers block for seconds on the API server; the Deployment
    index then lagged the watch by 30-70 s and Ready followed the pods as late."""
    for fn in (
        handlers.serving_index,
        handlers.deployment_index,
        handlers.lws_index,
        handlers.on_child_event,
    ):
        assert inspect.iscoroutinefunction(fn), fn.__name__


def test_no_handler_puts_a_finalizer_on_a_resource() -> None:
    """Regression (issue 38): a kopf timer served every resource, and kopf puts its finalizer
    on every object a timer serves: a resource deleted while no operator ran (uninstalled,
    stopped, a test's operator gone) stayed Terminating, and so did its namespace, whose
    controller re-listed every resource type for it over and over. Children go with their
    owner references; nothing the operator registers may require a finalizer."""
    registry = kopf.get_default_registry()
    handlers_ = [
        *registry._spawning.get_all_handlers(),
        *registry._changing.get_all_handlers(),
    ]
    assert handlers_, "the operator registered no handler"
    assert [str(h) for h in handlers_ if h.requires_finalizer] == []


def test_a_due_full_apply_survives_a_refresh_skipped_behind_a_running_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timer's full apply is queued; if that refresh finds the owner busy, the full apply
    stays due for the refresh the running pass queues when it ends."""
    calls: list[bool] = []
    busy = [True]

    def fake_pass(*_: Any, full: bool, **__: Any) -> Any:
        calls.append(full)
        return None if busy[0] else Outcome(status={})

    owner = {"metadata": META, "spec": {}, "status": {}}
    passes = Passes(no_kube, lookup=lambda key: [owner], workloads=lambda key: [])
    monkeypatch.setattr(passes, "run", fake_pass)
    passes._full_due.add(("ns", "demo"))
    passes.refresh(("ns", "demo"), time.monotonic())
    busy[0] = False
    passes.refresh(("ns", "demo"), time.monotonic())
    passes.refresh(("ns", "demo"), time.monotonic())
    assert calls == [True, True, False]


def test_the_safety_net_leaves_a_pending_create_to_its_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (bench-operator N=200: 88 duplicate full applies): a safety-net refresh
    before the resource's create pass ran in this process queued a full apply of its own."""
    queued: list[tuple[tuple[str, str], bool]] = []
    passes = Passes(no_kube)
    monkeypatch.setattr(passes, "queue", lambda key, full=False: queued.append((key, full)))
    monkeypatch.setattr(handlers, "PASSES", passes)
    resources = [{"metadata": META}]
    handlers.queue_safety_net(resources, time.monotonic())
    passes.last_full_apply["u1"] = time.monotonic()
    handlers.queue_safety_net(resources, time.monotonic())
    passes.last_full_apply["u1"] -= handlers.FULL_APPLY_SECONDS + 1
    handlers.queue_safety_net(resources, time.monotonic())
    assert [full for _, full in queued] == [False, False, True]


@pytest.mark.parametrize(
    ("server_copy", "passes_run"),
    [
        (None, 0),  # the owner is gone: its children were garbage-collected
        ({"metadata": {"uid": "u1", "deletionTimestamp": "2026-01-01T00:00:00Z"}}, 0),
        ({"metadata": {"uid": "other"}}, 0),  # a new object with the same name
        ({"metadata": {"uid": "u1"}}, 1),  # someone deleted a child: re-create it
    ],
)
def test_children_deleted_with_their_owner_are_not_recreated(
    monkeypatch: pytest.MonkeyPatch, server_copy: Any, passes_run: int
) -> None:
    """Guards the DELETED-event path against resurrecting the children of a deleted owner
    that the index still holds (its watch lags the garbage collector's deletes)."""
    ran: list[bool] = []

    class Server:
        def get(self, kind: str, namespace: str, name: str) -> Any:
            return server_copy

    owner = {"metadata": META, "spec": {}, "status": {}}
    passes = Passes(lambda: Server(), lookup=lambda key: [owner], workloads=lambda key: [])  # type: ignore[arg-type,return-value]
    monkeypatch.setattr(passes, "run", lambda *_, **__: ran.append(True))
    passes.child_deleted.add(("ns", "demo"))
    passes.refresh(("ns", "demo"), time.monotonic())
    assert len(ran) == passes_run
