"""The suite's order and grouping on xdist workers (tests/suite_plan.py)."""

from __future__ import annotations

from tests.suite_plan import CLUSTERWIDE_GROUP, SuiteItem, plan


def test_clusterwide_tests_come_first_as_one_group_and_fleets_last() -> None:
    """Regression guard: the e2e barrier holds tests that start their own operator until the
    clusterwide group is done; if that group were not the first unit handed out, a worker could
    hold a fleet test queued before it and wait on itself."""
    tests = [
        SuiteItem("e2e/tests/test_a.py::test_fleet", "fleet"),
        SuiteItem("tests/unit/test_u.py::test_u", "unit"),
        SuiteItem("e2e/tests/test_core.py::test_one", "fleet", clusterwide=True),
        SuiteItem("e2e/tests/test_h.py::test_harness", "e2e"),
        SuiteItem("e2e/tests/test_core.py::test_two", "fleet", clusterwide=True),
    ]
    suite = plan(tests, {})
    assert suite.order[:2] == [
        "e2e/tests/test_core.py::test_one",
        "e2e/tests/test_core.py::test_two",
    ]
    assert suite.order[-1] == "e2e/tests/test_a.py::test_fleet"
    assert suite.groups == {
        "e2e/tests/test_core.py::test_one": CLUSTERWIDE_GROUP,
        "e2e/tests/test_core.py::test_two": CLUSTERWIDE_GROUP,
    }


def test_longest_first_within_a_phase_and_module_state_keeps_a_module_together() -> None:
    """Regression guard: a long test handed out last leaves one worker running it while the
    others idle; a module-scoped fixture split over workers is set up once per worker."""
    tests = [
        SuiteItem("e2e/tests/test_m.py::test_a", "fleet", module_state=True),
        SuiteItem("e2e/tests/test_short.py::test_s", "fleet"),
        SuiteItem("e2e/tests/test_m.py::test_b", "fleet", module_state=True),
        SuiteItem("e2e/tests/test_long.py::test_l", "fleet"),
    ]
    seconds = {
        "e2e/tests/test_m.py::test_a": 30.0,
        "e2e/tests/test_m.py::test_b": 40.0,
        "e2e/tests/test_short.py::test_s": 10.0,
        "e2e/tests/test_long.py::test_l": 100.0,
    }
    suite = plan(tests, seconds)
    assert suite.order == [
        "e2e/tests/test_long.py::test_l",
        "e2e/tests/test_m.py::test_a",  # the module's 70 s, in collection order
        "e2e/tests/test_m.py::test_b",
        "e2e/tests/test_short.py::test_s",
    ]
    assert set(suite.groups.values()) == {"e2e/tests/test_m.py"}
