"""Build the plan of one CodingAgentServing (pure: never reads the cluster or the clock).

`build_plan(name, namespace, spec)` validates the spec and resolves the instance shapes, replica
counts, LayerSplit layout and revision (`desired.revision`: a hash of the rendered engine pods,
held at the recorded one while only the operator's rendering changed). It raises `InvalidSpec`
with every problem at once. `plan_raw` parses a stored spec first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from cas_operator.api import constants as c
from cas_operator.api.limits import OperatorLimits
from cas_operator.api.models import CodingAgentServingSpec, RatioMode, parse_spec
from cas_operator.autoscale.model import ObservedSignals
from cas_operator.autoscale.signals import shape_of
from cas_operator.desired.layersplit import kv_bytes_per_token_per_rank, layer_shards
from cas_operator.desired.plan import InvalidSpec, LayerLayout, Plan, PoolPlan
from cas_operator.desired.recommend import Recommendation, recommendation_for
from cas_operator.desired.replicas import ReplicaPlan, budget_errors, fixed_replicas
from cas_operator.desired.resolve import Resolved, resolve
from cas_operator.desired.resources.meta import dropped_user_keys
from cas_operator.desired.revision import RevisionRecord, choose, engine_input, engine_revision
from cas_operator.desired.shapes import instance_shape
from cas_operator.desired.validate import SpecError, limit_errors, surge_errors, validate


def _layout(spec: CodingAgentServingSpec, resolved: Resolved) -> LayerLayout | None:
    cp = spec.prefill.context_parallel
    profile = resolved.model
    if profile is None or cp <= 1:
        return None
    return LayerLayout(
        enabled=resolved.layer_split,
        num_layers=profile.num_layers,
        shards=tuple(layer_shards(profile.num_layers, cp)),
        footprint=kv_bytes_per_token_per_rank(profile, cp),
    )


def replica_plan(
    spec: CodingAgentServingSpec,
    recommendation: Recommendation | None,
    auto_replicas: tuple[int, int] | None = None,
) -> ReplicaPlan:
    """Fixed and Recommend: the spec's counts. Auto: the autoscaler's (`status.autoscaler`)
    once it has stepped; before that the spec's counts, never the planner's answer at once:
    the autoscaler's damped steps (bounded, cooled down) start from what runs, so switching a
    fleet to Auto cannot jump it from 2:4 to the planner's 10:20 in one pass."""
    plan = fixed_replicas(spec)
    if spec.ratio.mode == RatioMode.FIXED:
        return plan
    if spec.ratio.mode == RatioMode.AUTO and auto_replicas is not None:
        return ReplicaPlan(auto_replicas[0], auto_replicas[1], "Auto: autoscaler")
    if spec.ratio.mode == RatioMode.AUTO:
        planned = (
            f"; the planner says {recommendation.ratio}"
            if recommendation and recommendation.ratio
            else ""
        )
        return ReplicaPlan(
            plan.prefill, plan.decode, f"Auto: {plan.reason} until the autoscaler steps{planned}"
        )
    return ReplicaPlan(plan.prefill, plan.decode, f"{plan.reason} ({spec.ratio.mode.value} mode)")


def build_plan(
    name: str,
    namespace: str,
    spec: CodingAgentServingSpec,
    observed: ObservedSignals | None = None,
    auto_replicas: tuple[int, int] | None = None,
    *,
    recorded: RevisionRecord | None = None,
    generation: int = 0,
    limits: OperatorLimits = OperatorLimits(),
    keys_version: str = "",
) -> Plan:
    """Validate and resolve; raises InvalidSpec listing every error. `observed` (measured load)
    informs the planner; `auto_replicas` are Auto mode's current counts (see replica_plan);
    `recorded` is what the status says runs, at the resource's `generation` (revision.choose);
    `limits` are the operator's own bounds (its GPU cap per resource); `keys_version` the
    version of the keys the pods take (`desired.resources.security.keys_version`)."""
    resolved = resolve(spec)
    errors = validate(spec, resolved) + limit_errors(spec, limits)
    if errors:
        raise InvalidSpec(errors)
    prefill_shape = instance_shape(
        tensor_parallel=spec.prefill.tensor_parallel,
        gpus_per_node=spec.prefill.gpus_per_node,
        context_parallel=spec.prefill.context_parallel,
    )
    decode_shape = instance_shape(
        tensor_parallel=spec.decode.tensor_parallel, gpus_per_node=spec.decode.gpus_per_node
    )
    recommendation = recommendation_for(spec, prefill_shape, decode_shape, observed, resolved)
    replicas = replica_plan(spec, recommendation, auto_replicas)
    errors = budget_errors(spec, replicas, prefill_shape.gpus, decode_shape.gpus, limits)
    if errors and spec.ratio.mode == RatioMode.AUTO and replicas.reason.startswith("Auto: "):
        fixed = fixed_replicas(spec)  # the planner's answer breaks a bound: keep the spec's
        why = "; ".join(str(e) for e in errors)
        replicas = ReplicaPlan(
            fixed.prefill,
            fixed.decode,
            f"Auto: planner's {replicas.ratio} rejected ({why}); kept {fixed.ratio}",
        )
        errors = budget_errors(spec, replicas, prefill_shape.gpus, decode_shape.gpus, limits)
    full_gpus = replicas.prefill * prefill_shape.gpus + replicas.decode * decode_shape.gpus
    errors += surge_errors(spec, full_gpus, prefill_shape.gpus, decode_shape.gpus)
    if errors:
        raise InvalidSpec(errors)
    draft = Plan(
        warnings=spec_warnings(spec),
        name=name,
        namespace=namespace,
        revision="",
        spec=spec,
        prefill=PoolPlan(c.ROLE_PREFILL, "", replicas.prefill, prefill_shape),
        decode=PoolPlan(c.ROLE_DECODE, "", replicas.decode, decode_shape),
        replicas=replicas,
        layout=_layout(spec, resolved),
        layer_split=resolved.layer_split,
        cp_strategy=resolved.cp_strategy,
        recommendation=recommendation,
        operator_namespace=limits.operator_namespace,
        scraper_namespaces=limits.scraper_namespaces,
        measured_shape=shape_of(observed),
        refused_rate=None if observed is None else observed.refused_rate,
        keys_version=keys_version,
    )
    rendered, user_input = engine_revision(draft), engine_input(spec)
    runs = choose(
        recorded,
        rendered=rendered,
        engine_input=user_input,
        generation=generation,
        policy=spec.rollout.on_operator_upgrade,
        keys_version=keys_version,
    )
    return replace(draft, rendered_revision=rendered, engine_input=user_input).at_revision(runs)


def spec_warnings(spec: CodingAgentServingSpec) -> tuple[str, ...]:
    """What the plan leaves out of the spec without refusing it: pod metadata keys the
    operator sets itself."""
    user = spec.pod_metadata
    dropped = dropped_user_keys(user.labels, "labels")
    dropped += dropped_user_keys(user.annotations, "annotations")
    return tuple(f"{key}: the operator sets this key; dropped" for key in dropped)


def pydantic_errors(exc: ValidationError) -> list[SpecError]:
    """Pydantic's errors in the user's terms: `spec.prefill.tensorParallel: ...`."""
    errors = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(root)"
        errors.append(SpecError(path, err["msg"]))
    return errors


def plan_raw(
    name: str,
    namespace: str,
    raw_spec: dict[str, Any],
    observed: ObservedSignals | None = None,
    auto_replicas: tuple[int, int] | None = None,
    *,
    recorded: RevisionRecord | None = None,
    generation: int = 0,
    limits: OperatorLimits = OperatorLimits(),
    keys_version: str = "",
) -> Plan:
    """Parse a resource's `spec` as the API server stored it, then `build_plan`; raises
    InvalidSpec naming every bad field (schema errors included)."""
    try:
        spec = parse_spec(raw_spec)
    except ValidationError as exc:
        raise InvalidSpec(pydantic_errors(exc)) from exc
    return build_plan(
        name,
        namespace,
        spec,
        observed,
        auto_replicas,
        recorded=recorded,
        generation=generation,
        limits=limits,
        keys_version=keys_version,
    )
