"""Contract: the engine pods' probes and the routers' health checks wait for SGLang's /health.

Regression: the operator rendered the engine probes on `/health` without `timeoutSeconds`, so a
kubelet gave each one second. SGLang 0.5.23's `/health` (srt/entrypoints/http_server.py:721)
runs a one-token generation and looks for the scheduler's answer first after a second, so a
healthy engine answers after more than one second: every startup probe of a real SGLang pod
timed out, and after `STARTUP_SECONDS` the kubelet restarted it, forever. The sim answered at
once, so the local stack never showed it.

Runs SGLang's own handler (`health_generate`) with a stand-in tokenizer manager whose scheduler
answers at once, or never. Marked `sglang_real`: under CI a skip fails (tests/engine/conftest.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from cas_operator.api import constants as c
from cas_operator.desired.resources.router import health_check_args
from cas_operator.render import render
from tests.engine.sglang_real import sglang_import_problem
from tests.paths import load_sample

HTTP_SERVER = "sglang.srt.entrypoints.http_server"
WHY_NOT = sglang_import_problem(HTTP_SERVER)
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
SAMPLES = ("minimal.yaml", "glm5-long-context.yaml", "multinode-decode.yaml")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


class Scheduler:
    """The tokenizer manager's side of one health check: answers at once, or never."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.gracefully_exit = False
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, Any] = {}
        self.server_status: Any = None

    async def generate_request(self, request: Any, raw: Any) -> AsyncIterator[dict[str, Any]]:
        if self.answers:
            self.last_receive_tstamp = time.time()
            yield {"text": "x"}
        await asyncio.sleep(3600)  # a silent scheduler (cancelled by the handler)
        yield {}


@pytest.fixture
def sglang_health(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import importlib

    http = importlib.import_module(HTTP_SERVER)
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    disagg = SimpleNamespace(disaggregation_mode="prefill")
    monkeypatch.setattr(http, "get_disagg", lambda: disagg)

    def check(answers: bool) -> tuple[int, float]:
        manager = Scheduler(answers)
        manager.server_status = ServerStatus.Up
        monkeypatch.setattr(http, "_global_state", SimpleNamespace(tokenizer_manager=manager))
        request = SimpleNamespace(url=SimpleNamespace(path="/health"))
        start = time.monotonic()
        response = asyncio.run(http.health_generate(request))
        return int(response.status_code), time.monotonic() - start

    yield http, check


def engine_containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine containers of a pool's serving pods (an LWS group's leader)."""
    if manifest["kind"] == "LeaderWorkerSet":
        template = manifest["spec"]["leaderWorkerTemplate"].get("leaderTemplate") or {}
    elif manifest["kind"] == "Deployment":
        template = manifest["spec"]["template"]
    else:
        return []
    containers = template.get("spec", {}).get("containers", [])
    return [k for k in containers if k["name"] == "engine"]


def engine_probes() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for sample in SAMPLES:
        for manifest in render(load_sample(sample)):
            for container in engine_containers(manifest):
                for name in set(PROBES) & set(container):
                    yield manifest["metadata"]["name"], name, container[name]


def test_a_healthy_sglang_answers_after_a_second_and_every_probe_waits_for_it(
    sglang_health: Any,
) -> None:
    http, check = sglang_health
    status, took = check(answers=True)
    assert status == 200 and took >= 1.0, (status, took)  # what a 1 s probe never sees
    probes = list(engine_probes())
    assert {name for _, name, _ in probes} == set(PROBES), probes
    for owner, name, probe in probes:
        assert probe["httpGet"]["path"] == "/health", (owner, name)
        # the kubelet's default is 1 s; SGLang's own verdict (503) comes at HEALTH_CHECK_TIMEOUT
        timeout = probe.get("timeoutSeconds", 1)
        assert timeout > http.HEALTH_CHECK_TIMEOUT, (owner, name, timeout)
    routers = health_check_args()
    timeout = int(routers[routers.index("--health-check-timeout-secs") + 1])
    assert timeout == c.ENGINE_HEALTH_TIMEOUT_SECONDS > http.HEALTH_CHECK_TIMEOUT


def test_a_silent_scheduler_is_reported_unhealthy_within_the_probe_timeout(
    sglang_health: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the wait: a wedged scheduler gets SGLang's 503 (shortened here from
    HEALTH_CHECK_TIMEOUT to 2 s), before a probe of ENGINE_HEALTH_TIMEOUT_SECONDS gives up."""
    http, check = sglang_health
    monkeypatch.setattr(http, "HEALTH_CHECK_TIMEOUT", 2)
    status, took = check(answers=False)
    assert status == 503 and 2.0 <= took < 4.0, (status, took)
