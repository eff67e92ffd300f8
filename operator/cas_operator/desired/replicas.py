"""P:D replica counts (Fixed mode) and the ratio bounds and GPU budget they must respect
(checked by `autoscale.controller.ScaleBounds`, the one check every replica change passes)."""

from __future__ import annotations

from dataclasses import dataclass

from cas_operator.api.limits import MAX_GPUS_ENV, OperatorLimits
from cas_operator.api.models import CodingAgentServingSpec, RatioMode
from cas_operator.autoscale.controller import ScaleBounds
from cas_operator.desired.validate import SpecError


@dataclass(frozen=True)
class ReplicaPlan:
    prefill: int
    decode: int
    reason: str

    @property
    def ratio(self) -> str:
        return f"{self.prefill}:{self.decode}"


def fixed_replicas(spec: CodingAgentServingSpec) -> ReplicaPlan:
    """Fixed mode: a pool's own `replicas` wins; otherwise the counts of `ratio`."""
    prefill = spec.prefill.replicas
    decode = spec.decode.replicas
    if prefill is not None and decode is not None:
        return ReplicaPlan(prefill, decode, "replicas set on both pools")
    if prefill is None and decode is None:
        return ReplicaPlan(spec.ratio.prefill, spec.ratio.decode, "from ratio.prefill:decode")
    if prefill is None:
        assert decode is not None
        scaled = max(1, round(decode * spec.ratio.prefill / spec.ratio.decode))
        return ReplicaPlan(scaled, decode, "prefill derived from decode replicas and ratio")
    scaled = max(1, round(prefill * spec.ratio.decode / spec.ratio.prefill))
    return ReplicaPlan(prefill, scaled, "decode derived from prefill replicas and ratio")


def _replicas_field(spec: CodingAgentServingSpec) -> str:
    """The field that sets the replica counts: what to lower when they need too many GPUs."""
    if spec.ratio.mode == RatioMode.AUTO:
        return "ratio.gpuBudget"
    if spec.decode.replicas is not None:
        return "decode.replicas"
    return "prefill.replicas" if spec.prefill.replicas is not None else "ratio.decode"


def budget_errors(
    spec: CodingAgentServingSpec,
    plan: ReplicaPlan,
    prefill_gpus: int,
    decode_gpus: int,
    limits: OperatorLimits = OperatorLimits(),
) -> list[SpecError]:
    """The planned counts against ratio bounds, the GPU budget and the operator's cap."""
    errors = []
    total = plan.prefill * prefill_gpus + plan.decode * decode_gpus
    cap = limits.max_gpus_per_resource
    if cap is not None and total > cap:
        errors.append(
            SpecError(
                _replicas_field(spec),
                f"{plan.ratio} needs {total} GPUs, above this operator's cap of "
                f"{cap} per resource ({MAX_GPUS_ENV})",
            )
        )
    budget = spec.ratio.gpu_budget
    bounds = ScaleBounds(spec.ratio.min, spec.ratio.max, budget)
    if not bounds.fits(total):
        errors.append(
            SpecError("ratio.gpuBudget", f"{plan.ratio} needs {total} GPUs, budget is {budget}")
        )
    broken = bounds.ratio_problem(plan.prefill, plan.decode) if plan.decode > 0 else None
    if broken == "ratio.min":
        errors.append(SpecError("ratio.min", f"P:D {plan.ratio} is below {spec.ratio.min}"))
    elif broken == "ratio.max":
        errors.append(SpecError("ratio.max", f"P:D {plan.ratio} is above {spec.ratio.max}"))
    return errors
