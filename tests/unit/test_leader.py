"""Leader election over an in-memory Lease store that enforces resourceVersion preconditions
as the API server does (the real one: e2e/tests/test_operator_core.py)."""

from __future__ import annotations

import copy
from typing import Any

from cas_operator.leader import LeaderElection, Step, micro_time, next_step

T0 = 1_800_000_000.0


class Leases:
    """`Kube.get/create/replace` for Leases, with optimistic concurrency."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

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


def candidate(store: Leases, identity: str) -> LeaderElection:
    return LeaderElection(store, "ops", "cas-operator", identity)  # type: ignore[arg-type]


def test_next_step_reads_holder_and_expiry() -> None:
    lease = {"spec": {"holderIdentity": "a", "renewTime": micro_time(T0),
                      "leaseDurationSeconds": 15}}  # fmt: skip
    assert next_step(None, "a", T0) == Step.CREATE
    assert next_step(lease, "a", T0 + 1) == Step.RENEW
    assert next_step(lease, "b", T0 + 14) == Step.WAIT
    assert next_step(lease, "b", T0 + 15) == Step.TAKE


def test_one_of_two_candidates_leads_and_the_other_takes_over_only_after_expiry() -> None:
    """Regression (issue 17): two operator replicas both drained and both applied."""
    store = Leases()
    a, b = candidate(store, "a"), candidate(store, "b")
    assert a.try_lead(T0) and not b.try_lead(T0 + 1)
    assert a.try_lead(T0 + 5) and not b.try_lead(T0 + 19)  # renewed at T0 + 5
    assert b.try_lead(T0 + 20) and store.lease is not None
    assert store.lease["spec"]["holderIdentity"] == "b"
    assert store.lease["spec"]["leaseTransitions"] == 1
    assert a.attempt(T0 + 21) == Step.WAIT  # a now knows it lost the Lease


def test_two_candidates_taking_an_expired_lease_at_once_get_one_winner() -> None:
    store = Leases()
    candidate(store, "old").try_lead(T0)
    b, c = candidate(store, "b"), candidate(store, "c")
    read = store.get("Lease", "ops", "cas-operator")
    assert b.try_lead(T0 + 30)
    # c read the Lease before b wrote it: its write carries the older resourceVersion
    body = c.body(read, Step.TAKE, T0 + 30)
    assert store.replace("Lease", "ops", "cas-operator", body) is None
    assert store.lease is not None and store.lease["spec"]["holderIdentity"] == "b"
