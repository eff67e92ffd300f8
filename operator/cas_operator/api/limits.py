"""Bounds an installer sets for every resource the operator serves (flags and chart values).

Read once at start (`OperatorLimits.from_env`; `cas-operator --max-gpus-per-resource N` and
the chart's `maxGpusPerResource` set the variable) and passed down to the plan, whose
validation refuses a resource that would exceed them (`desired.build.build_plan`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_GPUS_ENV = "CAS_MAX_GPUS_PER_RESOURCE"


@dataclass(frozen=True)
class OperatorLimits:
    """`max_gpus_per_resource`: the most GPUs both pools of one resource may plan (None: no
    cap beyond the resource's own `ratio.gpuBudget`)."""

    max_gpus_per_resource: int | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorLimits:
        """From the environment; a value that is not a positive integer is refused at start."""
        raw = (os.environ if environ is None else environ).get(MAX_GPUS_ENV, "").strip()
        if not raw:
            return cls()
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{MAX_GPUS_ENV}={raw!r}: must be a positive integer")
        return cls(max_gpus_per_resource=int(raw))
