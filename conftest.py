"""How `make test` orders and groups the whole suite for pytest-xdist (``-n N``).

Before xdist names the groups, :func:`pytest_collection_modifyitems` turns each collected item
into a :class:`tests.suite_plan.SuiteItem` (its kind, whether it is ``clusterwide``, whether it uses
a module- or class-scoped fixture), asks :func:`tests.suite_plan.plan` for the order and the
groups, marks the grouped items ``xdist_group`` and reorders the items. The measured seconds
come from ``tests/durations.json`` (``make test-durations`` refreshes it from the last run's
report). Without xdist the order is the same, which is also a valid serial order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.suite_plan import SuiteItem, plan

DURATIONS = Path(__file__).resolve().parent / "tests" / "durations.json"


def _measured() -> dict[str, float]:
    if not DURATIONS.exists():
        return {}
    data: dict[str, float] = json.loads(DURATIONS.read_text())
    return data


def _test_of(item: pytest.Item) -> SuiteItem:
    info = getattr(item, "_fixtureinfo", None)
    scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs} if info else set()
    e2e = item.nodeid.split("/")[0] == "e2e"
    fleet = e2e and "crds" in getattr(item, "fixturenames", ())
    return SuiteItem(
        nodeid=item.nodeid,
        kind="fleet" if fleet else ("e2e" if e2e else "unit"),
        clusterwide=item.get_closest_marker("clusterwide") is not None,
        module_state=bool(scopes & {"module", "class", "package"}),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    by_id = {item.nodeid: item for item in items}
    suite = plan([_test_of(item) for item in items], _measured())
    for nodeid, group in suite.groups.items():
        item = by_id[nodeid]
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    items[:] = [by_id[nodeid] for nodeid in suite.order]
    if getattr(config.option, "loadgroup", False):  # set on xdist workers under loadgroup
        for item in items:
            name_group(item)


def name_group(item: pytest.Item) -> None:
    """Suffix the item's node id with ``@group``, which is how xdist's ``loadgroup`` scheduler
    finds a group. xdist 3.8 does this by setting ``item._nodeid``, which pytest 9.2 no longer
    reads (the id lives in ``item._id``): without this, every group is silently split across
    workers and the clusterwide tests run beside the namespaced ones. xdist's own suffixing,
    where it still works, appends the same group again, and the scheduler takes the last one."""
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})  # fmt: skip
    if not groups or item.nodeid.endswith("@" + "_".join(groups)):
        return
    named = f"{item.nodeid}@{'_'.join(groups)}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(named)
    else:
        item._nodeid = named
