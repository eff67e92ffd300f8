"""How `make test` orders and groups the whole suite for pytest-xdist (``-n N``).

Data flow: pytest collects ``tests/`` and ``e2e/tests/``; :func:`pytest_collection_modifyitems`
(here, before xdist names the groups) gives each item

1. an ``xdist_group`` when it shares state beyond one test: every item of a module that has a
   module- or class-scoped fixture goes to one worker, in module order, so that fixture is set
   up once; ``clusterwide`` items (an operator watching every namespace) form one group;
2. a place in the run: ``clusterwide`` first (so it is the first unit of work handed out, and the
   e2e barrier in ``e2e/tests/conftest.py`` can hold back namespaced operators until it is done),
   then the tests that start no operator of their own, then those that do (``crds``); inside
   each phase the longest first, from ``tests/durations.json`` (measured; ``make
   test-durations`` refreshes it from the last run's report), so the last work handed out is
   short and no worker idles at the end while another runs a long test.

Without xdist the order is the same, which is also a valid serial order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent / "tests" / "durations.json"
# unknown tests: a unit or engine test, an e2e test of the harness, an e2e test with a fleet
DEFAULT_SECONDS = {"unit": 0.5, "e2e": 5.0, "fleet": 60.0}
CLUSTERWIDE_GROUP = "clusterwide"


def _known_durations() -> dict[str, float]:
    if not DURATIONS.exists():
        return {}
    data: dict[str, float] = json.loads(DURATIONS.read_text())
    return data


def _module_state(item: pytest.Item) -> bool:
    """True when the item uses a fixture that lives longer than one test but not the session
    (module, class or package scope): its module must run on one worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        defs[-1].scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
        if defs
    )


def _kind(item: pytest.Item) -> str:
    if "e2e" not in item.nodeid.split("/")[0]:
        return "unit"
    return "fleet" if "crds" in getattr(item, "fixturenames", ()) else "e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = _known_durations()
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("clusterwide"):
            group = CLUSTERWIDE_GROUP
        elif _module_state(item):
            group = item.nodeid.split("::")[0]
        else:
            group = item.nodeid
        if group != item.nodeid and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)

    def key(members: list[pytest.Item]) -> tuple[int, float]:
        first = members[0]
        kind = _kind(first)
        phase = 0 if first.get_closest_marker("clusterwide") else (2 if kind == "fleet" else 1)
        seconds = sum(known.get(m.nodeid, DEFAULT_SECONDS[_kind(m)]) for m in members)
        return phase, -seconds

    items[:] = [item for members in sorted(groups.values(), key=key) for item in members]
