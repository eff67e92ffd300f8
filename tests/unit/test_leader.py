"""Leader election over an in-memory Lease store that enforces resourceVersion preconditions
as the API server does, and one that hangs (the real API server, behind a proxy that stalls:
e2e/tests/test_leader_election.py)."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest

from cas_operator.kube import Kube, NotLeading
from cas_operator.leader import LeaderElection, Seen, Step, micro_time, next_step, observe

T0 = 1_800_000_000.0


class Leases:
    """`Kube.get/create/replace` for Leases, with optimistic concurrency; `with_timeout`
    records the timeout each attempt gave its calls."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.timeouts: list[float] = []

    def with_timeout(self, seconds: float) -> Leases:
        self.timeouts.append(seconds)
        return self

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if self.lease is not None:
            return None
        return self._store(body)

    def replace(
        self, kind: str, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any] | None:
        if self.lease is None or body["metadata"]["resourceVersion"] != str(self.version):
            return None  # 409: written by someone else since it was read
        return self._store(body)

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": str(self.version)},
        }
        return copy.deepcopy(self.lease)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def candidate(store: Any, identity: str, clock: Any, **timing: float) -> LeaderElection:
    return LeaderElection(store, "ops", "cas-operator", identity, clock=clock, **timing)


def test_a_standby_takes_over_only_after_seeing_one_record_for_the_lease_duration() -> None:
    """Regression (issue 41): a standby took the Lease at renewTime + 15 s by its own wall
    clock, so a clock ahead of the holder's, or a holder whose renewal was slow to land, let
    both act. Now it counts 15 s from when it first saw the record, on its own clock; a
    renewTime that looks ancient changes nothing."""
    lease = {"metadata": {"resourceVersion": "7"},
             "spec": {"holderIdentity": "a", "renewTime": micro_time(T0 - 3600),
                      "leaseDurationSeconds": 15}}  # fmt: skip
    seen = observe(lease, None, 50.0)
    assert seen == Seen(("a", micro_time(T0 - 3600), "7"), 50.0)
    assert next_step(lease, "b", seen, 64.9, 15) == Step.WAIT
    assert next_step(lease, "b", seen, 65.0, 15) == Step.TAKE
    assert next_step(lease, "a", seen, 50.0, 15) == Step.RENEW
    assert next_step(None, "b", None, 50.0, 15) == Step.CREATE
    renewed = {**lease, "metadata": {"resourceVersion": "8"}}
    assert observe(renewed, seen, 60.0) == Seen(("a", micro_time(T0 - 3600), "8"), 60.0)
    assert observe(lease, seen, 99.0) is seen  # the same record: still seen since 50
    longer = copy.deepcopy(lease)
    longer["spec"]["leaseDurationSeconds"] = 30  # the holder's own, if longer, wins
    assert next_step(longer, "b", seen, 70.0, 15) == Step.WAIT


def test_one_of_two_candidates_leads_and_the_other_takes_over_only_after_it_stops() -> None:
    """Regression (issue 17): two operator replicas both drained and both applied."""
    store, clock = Leases(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    assert a.attempt() is None and b.attempt() == Step.WAIT
    clock.now += 14
    assert a.attempt() is None  # renewed: b starts counting again
    assert b.attempt() == Step.WAIT
    clock.now += 14.9
    assert b.attempt() == Step.WAIT
    clock.now += 0.1
    assert not a.leading()  # a's renew deadline (10 s) passed long before b could take
    assert b.attempt() is None and b.leading()
    assert store.lease is not None and store.lease["spec"]["holderIdentity"] == "b"
    assert store.lease["spec"]["leaseTransitions"] == 1
    assert a.attempt() == Step.WAIT  # a now knows it lost the Lease


def test_two_candidates_taking_a_lease_at_once_get_one_winner() -> None:
    store, clock = Leases(), Clock()
    candidate(store, "old", clock).attempt()
    b, c = candidate(store, "b", clock), candidate(store, "c", clock)
    b.attempt(), c.attempt()
    clock.now += 15
    read = store.get("Lease", "ops", "cas-operator")
    assert b.attempt() is None
    # c read the Lease before b wrote it: its write carries the older resourceVersion
    body = c.body(read, Step.TAKE, T0)
    assert store.replace("Lease", "ops", "cas-operator", body) is None
    assert store.lease is not None and store.lease["spec"]["holderIdentity"] == "b"


def test_the_holder_leads_until_its_last_renewals_start_plus_the_deadline() -> None:
    """Leading is counted from when the successful renewal was sent (its write landed after
    that), and each Lease call gives up at the deadline."""
    store, clock = Leases(), Clock()
    a = candidate(store, "a", clock)
    assert a.attempt() is None
    clock.now += 9.9
    assert a.leading()
    assert a.attempt() is None  # renewed at 109.9: leading until 119.9
    assert store.timeouts[-1] == pytest.approx(0.1)  # what was left of the deadline
    clock.now += 9.9
    assert a.leading()
    clock.now += 0.1
    assert not a.leading()
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        candidate(store, "x", clock, renew_deadline_seconds=15.0)


class Hanging(Leases):
    """The holder's view of the API: after `hang` is set, every call blocks (a stalled
    connection) until `release` is set."""

    def __init__(self, store: Leases) -> None:
        self.store = store
        self.hang, self.release = threading.Event(), threading.Event()

    def with_timeout(self, seconds: float) -> Hanging:
        return self

    def _wait(self) -> None:
        if self.hang.is_set():
            self.release.wait(30)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._wait()
        return self.store.get(kind, namespace, name)

    def replace(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> Any:
        self._wait()
        return self.store.replace(kind, namespace, name, body)

    def create(self, kind: str, namespace: str, body: dict[str, Any]) -> Any:
        self._wait()
        return self.store.create(kind, namespace, body)


def test_a_holder_whose_api_hangs_stops_before_a_standby_can_take_over() -> None:
    """Regression (issue 41): the holder noticed a lost Lease only after its blocking renew
    call returned (up to 30 s) plus 15 s, while a standby took over 15 s after the last
    renewal: both acted for tens of seconds. With the API hanging for the holder only, its
    watchdog stops it at the renew deadline, while its renew call still hangs, and the
    standby, which reads the Lease fine, takes over only later."""
    store = Leases()
    holder_api = Hanging(store)
    timing = {"duration_seconds": 1.5, "renew_deadline_seconds": 1.0, "retry_seconds": 0.1}
    holder = candidate(holder_api, "holder", time.monotonic, **timing)
    standby = candidate(store, "standby", time.monotonic, **timing)
    holder.acquire()
    lost: list[float] = []
    holder.keep(on_lost=lambda: lost.append(time.monotonic()))
    time.sleep(0.3)
    holder_api.hang.set()
    hung_at = time.monotonic()
    took = threading.Event()

    def stand_by() -> None:
        standby.acquire()
        took.set()

    taken_at: list[float] = []
    threading.Thread(target=lambda: (stand_by(), taken_at.append(time.monotonic())),
                     daemon=True).start()  # fmt: skip
    try:
        assert took.wait(5), "the standby never took over"
        assert lost, "the holder never stopped"
        assert lost[0] < taken_at[0], (lost[0] - hung_at, taken_at[0] - hung_at)
        assert lost[0] - hung_at <= 1.0 + 0.2  # at its deadline, while its call hangs
        assert not holder.leading()
    finally:
        holder_api.release.set()
        holder.stop()
        standby.stop()


class FakeApi:
    """The part of `kubernetes.client.ApiClient` `Kube._call` uses; records what is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def param_serialize(self, method: str, resource_path: str, **_: Any) -> Any:
        return method, resource_path, {}, None, None

    def call_api(self, method: str, url: str, **kw: Any) -> Any:
        self.sent.append((method, kw.get("_request_timeout")))

        class Answer:
            status, reason = 200, "OK"

            def read(self) -> bytes:
                return b"{}"

        return Answer()


def test_no_write_leaves_a_process_that_no_longer_leads() -> None:
    """Writes are gated on a live Lease: once `may_write` says no, a write raises unsent;
    reads still go (a standby's client reads too). Each call carries its timeout."""
    api = FakeApi()
    kube = Kube(api, timeout=30.0)  # type: ignore[arg-type]
    leading = [True]
    kube.may_write = lambda: leading[0]
    kube.patch("Deployment", "ns", "d", {"spec": {}})
    leading[0] = False
    with pytest.raises(NotLeading):
        kube.patch("Deployment", "ns", "d", {"spec": {}})
    with pytest.raises(NotLeading):
        kube.delete("Service", "ns", "s")
    kube.get("Deployment", "ns", "d")
    kube.with_timeout(2.5).get("Lease", "ns", "l")
    assert api.sent == [("PATCH", 30.0), ("GET", 30.0), ("GET", 2.5)]
