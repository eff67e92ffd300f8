"""The chart's Grafana dashboard against the local stack's Prometheus while traffic flows:
every panel's query (and both template variables) returns data, through the OPERATOR PROCESS
(its per-fleet gauges scraped from its metrics port), the real SGLang routers and the sims.

Regression guard (issue 17): a dashboard whose queries name a metric or label nobody exports
shows "No data" in every cluster that installs it, and nothing in CI would notice.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest

from cas_engine.sim.fleet import free_port, router_available
from e2e.fleet.fleetview import (
    NAME,
    Kubectl,
    control_key,
    router_workers,
    serving_decodes,
    speculative_sample,
)
from e2e.fleet.livestack import MakeLiveStack, http_ok, resource_live
from e2e.paths import REPO_ROOT as ROOT
from e2e.runtime.prometheus import prometheus_binary
from e2e.traffic.simload import LoadStats, steady_traffic
from e2e.waits import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]
DASHBOARD = ROOT / "charts/cas-operator/dashboards/cas-fleet.json"


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def variable_query(board: dict[str, Any], name: str) -> str:
    (var,) = [v for v in board["templating"]["list"] if v["name"] == name]
    return str(var["query"]["query"])


def substituted(expr: str, namespace: str) -> str:
    """As Grafana sends it for this fleet (rate interval: four 2 s scrapes and more)."""
    return (
        expr.replace("$namespace", namespace)
        .replace("$fleet", NAME)
        .replace("$__rate_interval", "30s")
    )


def instant(prometheus: str, expr: str) -> list[Any]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["status"] == "success", answer
    result: list[Any] = answer["data"]["result"]
    return result


def label_values(prometheus: str, query: str, namespace: str) -> list[str]:
    """Grafana's `label_values(selector, label)` through Prometheus' series API."""
    inner = substituted(query, namespace).removeprefix("label_values(").removesuffix(")")
    selector, label = (part.strip() for part in inner.rsplit(",", 1))
    params = urllib.parse.urlencode({"match[]": selector})
    with urllib.request.urlopen(f"{prometheus}/api/v1/series?{params}", timeout=10) as resp:
        series = json.loads(resp.read())["data"]
    return sorted({s[label] for s in series if label in s})


def test_every_panel_has_a_query_and_a_unique_id() -> None:
    board = dashboard()
    assert len(board["panels"]) >= 10
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert all(p["targets"] for p in board["panels"])


@pytest.mark.skipif(prometheus_binary() is None, reason="needs Prometheus (Debian package)")
async def test_every_panel_query_returns_data_while_traffic_flows(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    stack = live_stack(["--sim-speedup", "20"], metrics_port=free_port())
    cas = speculative_sample(2, window_s=30)
    # A limit (far above this traffic) for the admission panel: the sample's model has no
    # instance profile, so Auto would set none.
    cas["spec"]["router"] = {"admission": {"mode": "Fixed", "requestsPerSecond": 1000}}
    board = dashboard()
    with resource_live(stack, kubectl, cas, log=lambda s: print(f"[live] {s}")) as router:
        assert stack.prometheus is not None
        prom = stack.prometheus.url
        key = control_key(kubectl, namespace)
        await asyncio.to_thread(
            wait_for, "the router to list both decodes", lambda: http_ok(f"{router}/readiness")
            and len(serving_decodes(kubectl, namespace)) == 2
            and set(serving_decodes(kubectl, namespace).values()) <= router_workers(router, key),
            60,
        )  # fmt: skip
        stop, stats = asyncio.Event(), LoadStats()
        load = asyncio.create_task(steady_traffic(router, stop, stats, concurrency=4))
        try:
            queries = [(t, substituted(e, namespace)) for t, e in panel_queries(board)]

            def empty() -> list[str]:
                return [title for title, expr in queries if not instant(prom, expr)]

            deadline, missing = time.monotonic() + 150, await asyncio.to_thread(empty)
            while missing and time.monotonic() < deadline:
                await asyncio.sleep(3)
                missing = await asyncio.to_thread(empty)
            assert missing == [], f"panels without data: {missing}; {stats.ok} requests served"
            namespaces = label_values(prom, variable_query(board, "namespace"), namespace)
            assert namespace in namespaces
            fleets = label_values(prom, variable_query(board, "fleet"), namespace)
            assert fleets == [NAME]
        finally:
            stop.set()
            await load
    assert stats.ok > 0 and stats.failures == [], stats.failures[:5]
