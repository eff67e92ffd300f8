"""Signals from the Prometheus HTTP API: instant PromQL queries, one per signal, per namespace.

Data flow: `observe(targets, window)` groups targets by namespace, asks Prometheus for each
signal aggregated `by (namespace, pod)` (counters as `increase(...[window])`, the routers'
answers by status as `born_counted`, gauges as latest values), and joins the answers per pod.
Target health comes from `up` and the age of its last sample: a pod Prometheus does not
scrape, scrapes as down, or last scraped more than `stale_seconds` ago gets an explicit error
instead of numbers. A failed query (refused, timeout, non-2xx, `status: error`) marks the whole
observation as an outage: no partial joins.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cas_operator.observe import types as m
from cas_operator.observe.http import FetchError, post_form
from cas_operator.observe.types import Observation, PodSignals, PodTarget

Vector = dict[tuple[str, str], dict[str, float]]  # (namespace, pod) -> {extra label: value}


def promql_string(text: str) -> str:
    """Escape `text` for a double-quoted PromQL string (Go escapes: `\\-` alone is invalid)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


class QueryError(Exception):
    """Prometheus could not answer a query; the message names the query's purpose."""


@dataclass(frozen=True)
class PrometheusSource:
    """Prometheus at `url` (e.g. http://127.0.0.1:9090) whose pod targets carry the labels
    `pod_label` and `namespace_label` (the usual kubernetes_sd relabeling)."""

    url: str
    timeout_seconds: float = 5.0
    stale_seconds: float = 60.0
    pod_label: str = "pod"
    namespace_label: str = "namespace"
    max_answer_bytes: int = 16 * 1024 * 1024

    def observe(self, targets: Sequence[PodTarget], window_seconds: float) -> Observation:
        """Every target's signals, or an outage naming the first failed query."""
        out = Observation()
        by_ns: dict[str, list[PodTarget]] = {}
        for target in targets:
            by_ns.setdefault(target.namespace, []).append(target)
        for namespace, group in sorted(by_ns.items()):
            try:
                out.signals.update(self._namespace(namespace, group, window_seconds))
            except QueryError as exc:
                return Observation.outage(targets, f"prometheus unavailable: {exc}")
        return out

    def _namespace(
        self, namespace: str, group: list[PodTarget], window: float
    ) -> dict[str, PodSignals]:
        sel = self._selector(namespace, [t.name for t in group])
        w = f"[{int(max(window, 1))}s]"
        pod = f"{self.namespace_label}, {self.pod_label}"
        by = f"by ({pod})"
        # The routers' answers, by status: series created by their first answer of a status.
        answers = f"{m.ROUTER_RESPONSES}{sel}"
        errors = f'{m.ROUTER_RESPONSES}{{status_code=~"5..",{sel[1:]}'
        refused = f'{m.ROUTER_RESPONSES}{{status_code="429",{sel[1:]}'
        up_sel = f"up{sel}"
        up = self._query("up", f"max {by} ({up_sel})")
        age = self._query("age", f"max {by} (time() - timestamp({up_sel}))")
        counters = {
            m.CHECKED: self._query("checked", f"sum {by} (increase({m.CHECKED}{sel}{w}))"),
            m.ABORTED: self._query("aborted", f"sum {by} (increase({m.ABORTED}{sel}{w}))"),
            **{
                name: self._query(name, f"sum {by} (increase({name}{sel}{w}))")
                for name in (*m.LOAD_COUNTERS, *m.REUSE_COUNTERS)
            },
            m.RESPONSES: self._query(
                "router answers", f"sum {by} ({born_counted(answers, window, up_sel, pod)})"
            ),
            m.ERRORS_5XX: self._query(
                "router 5xx", f"sum {by} ({born_counted(errors, window, up_sel, pod)})"
            ),
            m.REFUSED: self._query(
                "router 429", f"sum {by} ({born_counted(refused, window, up_sel, pod)})"
            ),
        }
        recent = f"[{int(max(m.rate_window(window), 1))}s]"
        counters[m.RECENT_REQUESTS] = self._query(
            "recent requests", f"sum {by} (increase({m.REQUESTS}{sel}{recent}))"
        )
        failures = "|".join(m.KV_FAILURE_COUNTERS)
        counters[m.KV_FAILURES] = self._query(
            "kv failures", f'sum {by} (increase({{__name__=~"{failures}",{sel[1:]}{w}))'
        )
        ttft, itl, reuse = (
            self._query(
                purpose,
                f"sum by ({self.namespace_label}, {self.pod_label}, le) "
                f"(increase({histogram}{sel}{w}))",
                extra="le",
            )
            for purpose, histogram in (
                ("ttft", m.TTFT_BUCKET),
                ("itl", m.ITL_BUCKET),
                ("prompt reuse", m.REUSE_BUCKET),
            )
        )
        trips = self._query(
            "trips",
            f"sum by ({self.namespace_label}, {self.pod_label}, reason) "
            f"(increase({m.TRIPS}{sel}{w}))",
            extra="reason",
        )
        gauges = {
            m.UNHEALTHY: self._query("quarantine", f"max {by} ({m.UNHEALTHY}{sel})"),
            m.RUNNING: self._query("running", f"sum {by} ({m.RUNNING}{sel})"),
            m.QUEUED: self._query("queued", f"sum {by} ({m.QUEUED}{sel})"),
            m.TOKEN_USAGE: self._query("usage", f"max {by} ({m.TOKEN_USAGE}{sel})"),
        }
        queues = "|".join(m.KV_TRANSFER_QUEUES)
        gauges[m.KV_TRANSFERS] = self._query(
            "kv transfers", f'sum {by} ({{__name__=~"{queues}",{sel[1:]})'
        )
        result = {}
        for target in group:
            key = (namespace, target.name)
            problem = self._health(up.get(key), age.get(key))
            if problem is not None:
                result[target.name] = PodSignals(error=problem)
                continue
            pod_counters = {k: v[key][""] for k, v in counters.items() if key in v}
            pod_counters.update(trips.get(key, {}))
            pod_counters.update({m.bucket_key(le): v for le, v in ttft.get(key, {}).items()})
            pod_counters.update(
                {m.bucket_key(le, m.ITL_BUCKET): v for le, v in itl.get(key, {}).items()}
            )
            pod_counters.update(
                {m.bucket_key(le, m.REUSE_BUCKET): v for le, v in reuse.get(key, {}).items()}
            )
            pod_gauges = {k: v[key][""] for k, v in gauges.items() if key in v}
            result[target.name] = m.signals_from(
                pod_counters, pod_gauges, has_guard=m.CHECKED in pod_counters
            )
        return result

    def _health(self, up: dict[str, float] | None, age: dict[str, float] | None) -> str | None:
        """Why the pod's numbers cannot be trusted, or None."""
        if up is None:
            return "not scraped by Prometheus (no up series)"
        if up[""] < 0.5:
            return "Prometheus reports the scrape target down"
        if age is not None and age[""] > self.stale_seconds:
            return f"stale: last scrape {age['']:.0f}s ago"
        return None

    def _selector(self, namespace: str, names: list[str]) -> str:
        pods = "|".join(promql_string(re.escape(n)) for n in sorted(names))
        return f'{{{self.namespace_label}="{namespace}",{self.pod_label}=~"{pods}"}}'

    def _query(self, purpose: str, promql: str, extra: str | None = None) -> Vector:
        """One instant query -> {(namespace, pod): {extra label value or "": value}}."""
        try:
            raw = post_form(  # one batch names every engine pod of a namespace: long
                f"{self.url.rstrip('/')}/api/v1/query",
                {"query": promql},
                self.timeout_seconds,
                self.max_answer_bytes,
            )
            answer = json.loads(raw)
        except (FetchError, ValueError) as exc:
            raise QueryError(f"{purpose} query: {exc}") from exc
        if answer.get("status") != "success":
            raise QueryError(f"{purpose} query: {answer.get('error', 'no status')}")
        return self._vector(answer.get("data", {}), extra, purpose)

    def _vector(self, data: dict[str, Any], extra: str | None, purpose: str) -> Vector:
        if data.get("resultType") != "vector":
            raise QueryError(f"{purpose} query: expected a vector, got {data.get('resultType')}")
        out: Vector = {}
        for item in data.get("result", []):
            labels = item.get("metric", {})
            key = (labels.get(self.namespace_label, ""), labels.get(self.pod_label, ""))
            value = float(item["value"][1])
            if math.isnan(value):
                continue
            out.setdefault(key, {})[labels.get(extra, "") if extra else ""] = value
        return out


def born_counted(series: str, window: float, up: str, pod_labels: str) -> str:
    """`increase(series[window])`, where a series born inside the window counts from zero.

    A labelled counter is created by its first event (a router's first 429 or 5xx), and
    `increase` starts from a series' first sample, so a burst that created the series read as
    nothing. A series is born in the window only if it had no sample a window ago *and* its
    target (`up`, per `pod_labels`, e.g. "namespace, pod") was scraped successfully more often in
    the window than the series has samples: a scrape saw the process without it. Without that
    guard a Prometheus that restarted with an empty store read every old counter's whole value
    as new (a canary rolled back on 5xx answered hours before); with it that reads as
    `increase` does. Other series read as `increase` (a new pod's first scrape may already
    carry some answers: not counted, as before).
    """
    w = f"{int(max(window, 1))}s"
    scraped_without = (
        f"count_over_time({series}[{w}]) < on ({pod_labels}) group_left() "
        f"max by ({pod_labels}) (sum_over_time({up}[{w}]))"
    )
    born = f"({series} unless {series} offset {w}) and ({scraped_without})"
    return f"({born}) or increase({series}[{w}])"
