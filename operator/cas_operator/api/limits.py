"""Bounds an installer sets for every resource the operator serves (flags and chart values),
and where the operator itself runs.

Read once at start (`OperatorLimits.from_env`; `cas-operator --max-gpus-per-resource N` and
the chart's `maxGpusPerResource` set the variable) and passed down to the plan, whose
validation refuses a resource that would exceed them (`desired.build.build_plan`). The
operator's namespace (`POD_NAMESPACE`, which the chart sets from the downward API) is where
the fleets' NetworkPolicies admit the operator pod from (`desired.resources.network`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_GPUS_ENV = "CAS_MAX_GPUS_PER_RESOURCE"
NAMESPACE_ENV = "POD_NAMESPACE"


@dataclass(frozen=True)
class OperatorLimits:
    """`max_gpus_per_resource`: the most GPUs both pools of one resource may plan (None: no
    cap beyond the resource's own `ratio.gpuBudget`); `operator_namespace`: the operator pod's
    namespace (None: not known, e.g. run outside a pod)."""

    max_gpus_per_resource: int | None = None
    operator_namespace: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorLimits:
        """From the environment; a value that is not a positive integer is refused at start."""
        env = os.environ if environ is None else environ
        raw = env.get(MAX_GPUS_ENV, "").strip()
        namespace = env.get(NAMESPACE_ENV, "").strip() or None
        if not raw:
            return cls(operator_namespace=namespace)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{MAX_GPUS_ENV}={raw!r}: must be a positive integer")
        return cls(max_gpus_per_resource=int(raw), operator_namespace=namespace)
