"""What each real router does with the admission flags the operator renders: sglang-router 0.3.2
and smg 1.13 on loopback, in PD mode over one prefill and one decode sim (speedup 1, so a long
request stays in flight for the test's whole length).

Regression (issue 41, item 10): the operator sized both routers as a token bucket of requests
(`--rate-limit-tokens-per-second` the fleet's rate, `--max-concurrent-requests` 5 s of it), and
the planner, its benchmark and docs/planner.md took "each router admits at most what the pools
serve". sglang-router 0.3.2's bucket gets a token back when a response ends: it admits what
completes plus its refill, so requests in flight grew by the rate each second a saturated fleet
was offered more. And for smg, `status.admission.perRouter.burst` said 5 s of the rate while smg
admits `--max-concurrent-requests` at once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cas_engine.sim.fleet import Fleet, free_port, router_available
from cas_operator.api.models import parse_spec
from cas_operator.desired.admission import ROUTER_032_REFILL
from cas_operator.desired.build import build_plan
from cas_operator.desired.resources.router import ROUTER_COMMANDS, admission_args
from cas_operator.reconcile.status import admission_status

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.timeout(240),
]
IMPLEMENTATIONS = ("sglang-router", "smg")
MODEL = "sim/glm-5-class"  # what the sims serve (smg routes only requests that name it)
LONG = 4000  # tokens: at speedup 1 such a request runs far longer than any test here


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(prefills=1, decodes=1, speedup=1.0, log_dir=Path(tmp_path_factory.mktemp("adm")))
    f.start()
    try:
        yield f
    finally:
        f.stop()


class Router:
    """One router process over the fleet's workers with `flags`; stopped by its pid."""

    def __init__(self, fleet: Fleet, implementation: str, flags: list[str], log: Path) -> None:
        module = ROUTER_COMMANDS[parse_spec({"model": {"name": "x"}, "router": {
            "implementation": implementation}}).router.implementation][-1]  # fmt: skip
        port = free_port()
        # as the router's image runs it, without SGLang (cas_engine.sim.router_launch)
        cmd = [sys.executable, "-m", "cas_engine.sim.router_launch", module,
               "--pd-disaggregation", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(free_port()), "--policy",
               "round_robin", "--prefill", fleet.prefill_urls[0], str(fleet.bootstrap_ports[0]),
               "--decode", fleet.decode_urls[0], "--log-level", "warn", *flags]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=2) as resp:
                return int(resp.status) == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def body(tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "fix it"}],
            "max_tokens": tokens, "ignore_eos": True}  # fmt: skip


def post(url: str, tokens: int) -> int:
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body(tokens)).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def refused_of(url: str, starts: list[float], settle: float = 1.5) -> int:
    """Long requests started at `starts` (seconds from now): how many were refused (429, which
    comes at once) by `settle` seconds after the last start. The admitted ones are held open
    until then (one that ended would give 0.3.2 its token back) and then cut."""
    refused = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(delay: float) -> None:
            nonlocal refused
            await asyncio.sleep(delay)
            async with session.post(f"{url}/v1/chat/completions", json=body(LONG)) as resp:
                refused += resp.status == 429
                await resp.read()

        tasks = [asyncio.create_task(one(t)) for t in starts]
        await asyncio.sleep(max(starts) + settle)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return refused


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sglang_router_takes_a_token_back_when_a_response_ends_and_smg_does_not(
    fleet: Fleet, implementation: str, tmp_path: Path
) -> None:
    """`--max-concurrent-requests 2 --rate-limit-tokens-per-second 1 --queue-size 0`, 20 short
    requests one after the other: 0.3.2 admits every one (each finished one gave its token
    back); smg admits its burst of 2 and what its refill adds meanwhile, and refuses the rest."""
    flags = ["--max-concurrent-requests", "2", "--rate-limit-tokens-per-second", "1",
             "--queue-size", "0"]  # fmt: skip
    router = Router(fleet, implementation, flags, tmp_path / "router.log")
    try:  # a router starts with a full bucket
        started = time.monotonic()
        codes = [post(router.url, 1) for _ in range(20)]
        elapsed = time.monotonic() - started
    finally:
        router.stop()
    if implementation == "sglang-router":
        assert codes == [200] * 20, codes
    else:
        admitted = codes.count(200)
        assert set(codes) == {200, 429} and 2 <= admitted <= 2 + int(elapsed) + 1, (codes, elapsed)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_in_flight_under_saturation_is_the_size_for_smg_and_grows_by_the_refill_for_0_3_2(
    fleet: Fleet, implementation: str, tmp_path: Path
) -> None:
    """A saturated router (a long request tried every 0.1 s for 6 s, none finishing): smg holds
    `--max-concurrent-requests` in flight and no more; 0.3.2 that many plus its refill per
    second (what `desired.admission` sizes it for: the size, and a refill of 1)."""
    size, refill, seconds = 3, 1, 6.0
    flags = ["--max-concurrent-requests", str(size), "--rate-limit-tokens-per-second",
             str(refill), "--queue-size", "0"]  # fmt: skip
    router = Router(fleet, implementation, flags, tmp_path / "router.log")
    try:  # a router starts with a full bucket
        starts = [i * 0.1 for i in range(int(seconds * 10))]
        admitted = len(starts) - asyncio.run(refused_of(router.url, starts))
    finally:
        router.stop()
    if implementation == "smg":
        assert admitted == size, admitted
    else:
        grown = refill * seconds
        assert size + grown - 2 <= admitted <= size + grown + 2, admitted


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_status_reports_the_burst_the_router_applies(
    fleet: Fleet, implementation: str, tmp_path: Path
) -> None:
    """The operator's own flags for an Auto GLM-5 fleet of 1P:1D and one router: a burst of
    that many plus 20 long requests at once is admitted up to `status.admission.perRouter.burst`
    (regression: for smg status said 5 s of the rate, while smg admits its
    `--max-concurrent-requests`, which the operator sets to what the pools hold)."""
    router_spec = {"replicas": 1, "implementation": implementation}
    spec = {"model": {"name": "zai-org/GLM-5-FP8"}, "prefill": {"replicas": 1},
            "decode": {"replicas": 1}, "router": router_spec}  # fmt: skip
    plan = build_plan("demo", "ns", parse_spec(spec))
    per_router = admission_status(plan)["perRouter"]
    flags = admission_args(plan)
    if implementation == "sglang-router":
        assert per_router["requestsPerSecond"] == ROUTER_032_REFILL
    router = Router(fleet, implementation, flags, tmp_path / "router.log")
    try:  # a router starts with a full bucket
        burst = per_router["burst"] + 20
        admitted = burst - asyncio.run(refused_of(router.url, [0.0] * burst, settle=2.0))
    finally:
        router.stop()
    slack = 0 if implementation == "smg" else 2  # 0.3.2's refill while the burst arrives
    assert per_router["burst"] <= admitted <= per_router["burst"] + slack, (admitted, per_router)
