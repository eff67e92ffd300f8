"""The order and grouping of the suite on pytest-xdist workers (pure; the root ``conftest.py``
adapts pytest's items to :class:`SuiteItem` records and applies the plan).

A test is grouped with the rest of its module when the module keeps state between tests (a
module- or class-scoped fixture), and with every ``clusterwide`` test (they share one operator
that watches every namespace). Groups run in three phases: clusterwide first, then tests that
start no operator of their own, then those that do (``fleet``); inside a phase, longest first
(measured seconds, else a default by kind), so the last work handed out is short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CLUSTERWIDE_GROUP = "clusterwide"
# unknown tests: a unit or engine test, an e2e test of the harness, an e2e test with a fleet
DEFAULT_SECONDS = {"unit": 0.5, "e2e": 5.0, "fleet": 60.0}


@dataclass(frozen=True)
class SuiteItem:
    nodeid: str
    kind: str  # unit | e2e | fleet (an e2e test that starts an operator: it needs `crds`)
    clusterwide: bool = False
    module_state: bool = False  # uses a fixture scoped to its module or class


@dataclass(frozen=True)
class Plan:
    order: list[str]  # node ids in the order to hand them out
    groups: dict[str, str]  # node id -> xdist group, for tests that must share a worker


def group_of(test: SuiteItem) -> str:
    if test.clusterwide:
        return CLUSTERWIDE_GROUP
    if test.module_state:
        return test.nodeid.split("::")[0]
    return test.nodeid


def plan(tests: Sequence[SuiteItem], seconds: Mapping[str, float]) -> Plan:
    """See the module docstring. Tests keep their collection order inside a group."""
    members: dict[str, list[SuiteItem]] = {}
    for test in tests:
        members.setdefault(group_of(test), []).append(test)

    def key(group: list[SuiteItem]) -> tuple[int, float]:
        first = group[0]
        phase = 0 if first.clusterwide else (2 if first.kind == "fleet" else 1)
        total = sum(seconds.get(t.nodeid, DEFAULT_SECONDS[t.kind]) for t in group)
        return phase, -total

    ordered = sorted(members.values(), key=key)  # stable: equal keys keep collection order
    return Plan(
        order=[t.nodeid for group in ordered for t in group],
        groups={t.nodeid: g for t in tests if (g := group_of(t)) != t.nodeid},
    )
