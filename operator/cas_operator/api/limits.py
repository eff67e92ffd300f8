"""Bounds an installer sets for every resource the operator serves (flags and chart values),
and where the operator itself runs.

Read once at start (`OperatorLimits.from_env`; `cas-operator --max-gpus-per-resource N` and
the chart's `maxGpusPerResource` set the variable) and passed down to the plan, whose
validation refuses a resource that would exceed them (`desired.build.build_plan`). The
operator's namespace (`POD_NAMESPACE`, which the chart sets from the downward API) is where
the fleets' NetworkPolicies admit the operator pod from (`desired.resources.network`);
unknown (run outside a pod), no policy admits an operator pod. The metrics scrapers' namespaces
(`cas-operator --metrics-scraper-namespace NS`, repeatable, or the chart's
`metricsScraperNamespaces`, which set `CAS_METRICS_SCRAPER_NAMESPACES`) are where those
policies admit Prometheus pods from when a resource names no `metricsFrom`; none: no scraper
is admitted, never every namespace.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MAX_GPUS_ENV = "CAS_MAX_GPUS_PER_RESOURCE"
NAMESPACE_ENV = "POD_NAMESPACE"
SCRAPER_NAMESPACES_ENV = "CAS_METRICS_SCRAPER_NAMESPACES"  # comma-separated
NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label


@dataclass(frozen=True)
class OperatorLimits:
    """`max_gpus_per_resource`: the most GPUs both pools of one resource may plan (None: no
    cap beyond the resource's own `ratio.gpuBudget`); `operator_namespace`: the operator pod's
    namespace (None: not known, e.g. run outside a pod); `scraper_namespaces`: where the
    metrics scrapers run (empty: none admitted)."""

    max_gpus_per_resource: int | None = None
    operator_namespace: str | None = None
    scraper_namespaces: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorLimits:
        """From the environment; a GPU cap that is not a positive integer, or a scraper
        namespace that is not a namespace name, is refused at start."""
        env = os.environ if environ is None else environ
        raw = env.get(MAX_GPUS_ENV, "").strip()
        namespace = env.get(NAMESPACE_ENV, "").strip() or None
        scrapers = tuple(n.strip() for n in env.get(SCRAPER_NAMESPACES_ENV, "").split(","))
        scrapers = tuple(dict.fromkeys(n for n in scrapers if n))
        for name in scrapers:
            if not NAMESPACE_NAME.match(name):
                raise ValueError(f"{SCRAPER_NAMESPACES_ENV}: {name!r} is not a namespace name")
        if raw and (not raw.isdigit() or int(raw) < 1):
            raise ValueError(f"{MAX_GPUS_ENV}={raw!r}: must be a positive integer")
        return cls(
            max_gpus_per_resource=int(raw) if raw else None,
            operator_namespace=namespace,
            scraper_namespaces=scrapers,
        )
