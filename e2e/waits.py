"""The one way e2e tests and the harness wait for a condition or a clock, and a record of each.

`wait_for` polls a probe until it returns something truthy (TimeoutError naming what it waited
for); `pause` sleeps for a stated reason. Both append one JSON line per wait to the file named
by ``$CAS_E2E_WAIT_LOG`` when it is set (``{"test", "phase", "what", "seconds", "ok"}``; the
test and phase from pytest's ``PYTEST_CURRENT_TEST``), so a run can say where each test spent
its time: ``python tools/test_durations.py run/junit.xml --waits run/waits.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

WAIT_LOG_ENV = "CAS_E2E_WAIT_LOG"


def record(what: str, seconds: float, ok: bool = True) -> None:
    """Append one wait to ``$CAS_E2E_WAIT_LOG`` (nothing when unset)."""
    path = os.environ.get(WAIT_LOG_ENV)
    if not path:
        return
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    test, _, phase = current.rpartition(" ")
    line = {"test": test or current, "phase": phase.strip("()"), "what": what,
            "seconds": round(seconds, 2), "ok": ok}  # fmt: skip
    with open(path, "a") as out:  # one short append per wait: lines of workers do not mix
        out.write(json.dumps(line) + "\n")


MAX_INTERVAL_S = 1.0  # a long wait polls once a second: most probes run kubectl (~55 ms CPU)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 0.25) -> Any:
    """Poll `probe` until truthy and return its value; TimeoutError naming `what` after
    `timeout` seconds. The first polls are `interval` apart, then each 1.5 times the last, up
    to MAX_INTERVAL_S (or `interval`, if larger): quick conditions are seen quickly, and a
    minute's wait costs ~60 probes, not 240."""
    start = time.monotonic()
    deadline = start + timeout
    ceiling = max(interval, MAX_INTERVAL_S)
    while time.monotonic() < deadline:
        value = probe()
        if value:
            record(what, time.monotonic() - start)
            return value
        time.sleep(interval)
        interval = min(interval * 1.5, ceiling)
    record(what, time.monotonic() - start, ok=False)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def pause(seconds: float, why: str) -> None:
    """Sleep `seconds` for a clock the test must let pass (`why` says which)."""
    time.sleep(seconds)
    record(f"pause: {why}", seconds)
