"""A decode whose process died leaves the REAL SGLang router's rotation within the operator's
health-check bound (one prefill, two decode sims, loopback).

Regression: the router's Kubernetes discovery drops a worker only when its pod is deleted, and
its default health checks (every 60 s, three failures) kept a dead decode in rotation for up to
three minutes. A request paired with it waited for its prefill's bootstrap timeout (SGLang's
300 s; the sim's, at speedup 10, 30 s) before the router retried elsewhere. The operator renders
the checks `desired.resources.router.health_check_args` returns; this runs the router with them.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cas_engine.sim.fleet import Fleet, router_available
from cas_operator.desired.resources.router import (
    HEALTH_CHECK_INTERVAL_SECONDS,
    HEALTH_FAILURE_THRESHOLD,
    health_check_args,
)

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.timeout(180),
    pytest.mark.slow,
]
SPEEDUP = 10.0  # the sim's bootstrap timeout, 300 sim s, is 30 s of wall time
# a dead process refuses at once: `threshold` checks fail within that many intervals, plus one
# interval for where the checker's clock stands when the process dies
BOUND_S = HEALTH_CHECK_INTERVAL_SECONDS * (HEALTH_FAILURE_THRESHOLD + 1)
SPACING_S = 0.5
AFTER_S = 6.0  # how long past the bound requests keep coming
FAST_S = 3.0  # a request that reached a live decode (at speedup 10: well under a second)


def chat(url: str) -> tuple[int, float]:
    """Status and wall seconds of one short chat request through the router."""
    body = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=90) as resp:
            status = int(resp.status)
    except urllib.error.HTTPError as exc:
        status = int(exc.code)
    except OSError:
        status = 0
    return status, time.monotonic() - start


def test_a_dead_decode_leaves_rotation_within_the_health_check_bound(tmp_path: Path) -> None:
    fleet = Fleet(prefills=1, decodes=2, speedup=SPEEDUP, log_dir=tmp_path / "fleet",
                  router_args=health_check_args()).start()  # fmt: skip
    try:
        assert [chat(fleet.router_url)[0] for _ in range(4)] == [200] * 4
        crash = urllib.request.Request(f"{fleet.decode_urls[0]}/sim/fault", data=b"crash=1")
        with urllib.request.urlopen(crash, timeout=5) as resp:
            assert resp.status == 200
        died = time.monotonic()
        starts = [i * SPACING_S for i in range(int((BOUND_S + AFTER_S) / SPACING_S))]

        def at(offset: float) -> tuple[float, int, float]:
            time.sleep(max(0.0, died + offset - time.monotonic()))
            return (offset, *chat(fleet.router_url))

        with ThreadPoolExecutor(len(starts)) as pool:
            results = list(pool.map(at, starts))
    finally:
        fleet.stop()
    early = [r for r in results if r[0] < HEALTH_CHECK_INTERVAL_SECONDS]
    late = [r for r in results if r[0] >= BOUND_S]
    # the decode was dead and in rotation: some early request waited out the bootstrap timeout
    assert any(took > FAST_S for _, _, took in early), early
    assert all(status == 200 for _, status, _ in results), results  # retried elsewhere
    slow = [r for r in late if r[2] > FAST_S]
    assert not slow, f"still routed to the dead decode {BOUND_S} s after it died: {slow}"
