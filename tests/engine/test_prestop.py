"""The engine pod's preStop hook (cas_engine.prestop): it holds the pod's shutdown until the
engine has nothing in flight, bounded by the grace.

Regression guarded (issue 15): engine pods had no preStop, so a deleted pod (scale-down, a
retired revision, an eviction) got SIGTERM at once and cut every request it was running.
The pure halves are checked on SGLang-shaped text; the hook itself runs as its own process
against a sim engine with a request in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cas_engine.prestop import DrainWait, in_flight
from cas_engine.sim.fleet import Fleet

SGLANG_SCRAPE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 2.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1"} 1.0
# HELP sglang:num_prefill_inflight_queue_reqs The number of requests in the prefill inflight queue.
# TYPE sglang:num_prefill_inflight_queue_reqs gauge
sglang:num_prefill_inflight_queue_reqs{model_name="m",tp_rank="0"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
"""


def test_in_flight_sums_every_request_gauge_over_ranks() -> None:
    assert in_flight(SGLANG_SCRAPE) == 7  # running on both ranks + KV sends in flight
    assert in_flight("# TYPE other gauge\nother 3\n") is None


def test_the_wait_ends_idle_after_settling_or_when_the_grace_is_spent() -> None:
    wait = DrainWait(grace_s=30, settle_s=5)
    assert not wait.step(0, 3, True).done
    assert not wait.step(4, 0, True).done  # idle, not yet settled
    assert not wait.step(6, 1, True).done  # busy again: the settle starts over
    assert not wait.step(8, 0, True).done
    assert wait.step(13, 0, True).reason == "idle"
    spent = DrainWait(grace_s=10, settle_s=5)
    assert not spent.step(0, 1, True).done
    assert spent.step(10, 1, True).reason == "grace spent with 1 in flight"
    assert DrainWait(grace_s=10).step(0, 1, False).reason == "engine gone"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(prefills=1, decodes=1, speedup=1.0, log_dir=tmp_path)
    f.start()
    yield f
    f.stop()


def _running(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        return in_flight(resp.read().decode()) or 0


def _long_request(router: str, done: dict[str, float | int]) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "refactor"}],
            "max_tokens": 400, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(f"{router}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        done["status"] = resp.status
        done["tokens"] = json.loads(resp.read())["usage"]["completion_tokens"]
    done["at"] = time.monotonic()


def _prestop(port: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cas_engine.prestop", "--port", port, *args],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _request_in_flight(fleet: Fleet) -> tuple[threading.Thread, dict[str, float | int], str]:
    """A long request through the router, once it runs on the decode worker: the client
    thread, what it will record, and the decode's URL."""
    done: dict[str, float | int] = {}
    client = threading.Thread(target=_long_request, args=(fleet.router_url, done))
    client.start()
    decode = fleet.decode_urls[0]
    deadline = time.monotonic() + 30
    while _running(decode) == 0:
        assert time.monotonic() < deadline, "the request never reached the decode worker"
        time.sleep(0.05)
    return client, done, decode


def test_the_hook_returns_only_after_the_request_in_flight_finished(fleet: Fleet) -> None:
    client, done, decode = _request_in_flight(fleet)
    started = time.monotonic()
    hook = _prestop(decode.rsplit(":", 1)[1], "--grace", "120", "--settle", "1")
    out, _ = hook.communicate(timeout=150)
    ended = time.monotonic()
    client.join(timeout=30)
    assert hook.returncode == 0 and "preStop: idle" in out, out
    assert done.get("status") == 200 and done.get("tokens") == 400, done
    assert float(done["at"]) - started > 1.0, "the request ended before the hook could wait"
    assert ended >= float(done["at"]) + 1.0, (ended, done)  # waited, then settled 1 s


def test_the_hook_gives_up_at_the_grace_and_still_exits_zero(fleet: Fleet) -> None:
    client, _, decode = _request_in_flight(fleet)
    started = time.monotonic()
    hook = _prestop(decode.rsplit(":", 1)[1], "--grace", "1", "--settle", "1")
    out, _ = hook.communicate(timeout=60)
    took = time.monotonic() - started
    client.join(timeout=120)
    assert hook.returncode == 0 and "grace spent with 1 in flight" in out, out
    assert took < 10, took
