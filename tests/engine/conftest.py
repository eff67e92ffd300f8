"""Engine tests: a skipped real-SGLang test fails under CI.

Tests marked ``sglang_real`` run SGLang 0.5.23's own code (``make setup`` installs it with its
CPU-importable dependencies, ``engine/requirements-sglang-cpu.txt``). Locally they skip where
SGLang does not import; under CI (``CI`` set, as ``.ci/run`` does, or
``CAS_REQUIRE_SGLANG=1``) such a skip is reported as a failure, so a broken dependency closure
cannot turn the adapters' only checks against the real code into a silent pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any

import pytest

MARKER = "sglang_real"
REQUIRE_ENV = "CAS_REQUIRE_SGLANG"


def sglang_required(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """True under CI (``CI`` set and not false/0) or when ``CAS_REQUIRE_SGLANG=1``."""
    ci = environ.get("CI", "").strip().lower()
    return (ci not in ("", "0", "false", "no")) or environ.get(REQUIRE_ENV, "") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: runs real SGLang code; a skip fails under CI or {REQUIRE_ENV}=1",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[Any]:
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and item.get_closest_marker(MARKER) and sglang_required()):
        return
    if hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid}: real-SGLang test skipped under CI ({reason}). "
        "`make setup` installs SGLang and engine/requirements-sglang-cpu.txt; "
        f"unset CI and {REQUIRE_ENV} to allow the skip locally."
    )


RACE_NICENESS = -10  # ahead of the suite's other processes (all at 0)


@pytest.fixture
def scheduler_priority() -> Generator[None, None, None]:
    """Run the test (and the processes it starts, which inherit it) ahead of the rest of the
    suite on the CPU. The race harness's subject is a write stalled past a 50 ms budget by an
    injected stall; on a 2-core machine running the suite in four workers beside a cluster, CPU
    starvation stalls every write instead and the run proves nothing (every request aborted).
    Raising priority needs root (CI runs as root); elsewhere the test runs as it is."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, RACE_NICENESS)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)  # lowering priority back is always allowed
