"""The resolved plan of one CodingAgentServing: everything the builders need (the types).

`desired.build.build_plan` makes one (validated, pure); `desired.resources` renders it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cas_operator.api.models import CodingAgentServingSpec
from cas_operator.autoscale.signals import Shape
from cas_operator.desired.layersplit import KvFootprint, LayerShard
from cas_operator.desired.recommend import Recommendation
from cas_operator.desired.replicas import ReplicaPlan
from cas_operator.desired.shapes import InstanceShape
from cas_operator.desired.validate import SpecError


class InvalidSpec(ValueError):
    """The spec cannot be planned; `errors` name each field."""

    def __init__(self, errors: list[SpecError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


@dataclass(frozen=True)
class PoolPlan:
    role: str
    workload_name: str
    replicas: int
    shape: InstanceShape

    @property
    def gpus(self) -> int:
        return self.replicas * self.shape.gpus


@dataclass(frozen=True)
class LayerLayout:
    """LayerSplit (or replicated) KV layout of one prefill instance's CP ranks."""

    enabled: bool
    num_layers: int
    shards: tuple[LayerShard, ...]
    footprint: KvFootprint


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    revision: str
    spec: CodingAgentServingSpec
    prefill: PoolPlan
    decode: PoolPlan
    replicas: ReplicaPlan
    layout: LayerLayout | None
    layer_split: bool = False  # the prefill pool runs LayerSplit (`resolve`)
    cp_strategy: str | None = None  # the prefill pool's `--cp-strategy` (`resolve`)
    recommendation: Recommendation | None = None
    # What this operator renders for the spec (`desired.revision.engine_revision`); differs
    # from `revision` only while an operator upgrade is held (`desired.revision.choose`).
    rendered_revision: str = ""
    engine_input: str = ""  # hash of the user's engine settings (`desired.revision`)
    # the version of the keys the pods take (`desired.resources.security.keys_version`; "":
    # the keys Secret itself, before the reconcile has read it)
    keys_version: str = ""
    warnings: tuple[str, ...] = ()  # what the operator did not take from the spec, and why
    operator_namespace: str | None = None  # where the operator pod runs (api.limits)
    scraper_namespaces: tuple[str, ...] = ()  # where metrics scrapers run (api.limits)
    routers: int | None = None  # router replicas, when a rollout sets them (else the spec's)
    # the measured request shape (input, output tokens per request), when the fleet tick has it
    measured_shape: Shape | None = None
    # the routers' 429s per second over the fleet tick's window (status.admission shows it)
    refused_rate: float | None = None

    @property
    def held(self) -> bool:
        """An operator upgrade renders these engines differently; they keep `revision`."""
        return self.rendered_revision != self.revision

    def at_revision(self, revision: str) -> Plan:
        """This plan under `revision`: the revision label and the workload names carrying it."""
        return replace(
            self,
            revision=revision,
            prefill=replace(self.prefill, workload_name=f"{self.name}-prefill-{revision}"),
            decode=replace(self.decode, workload_name=f"{self.name}-decode-{revision}"),
        )

    def sized(self, prefill: int, decode: int, routers: int) -> Plan:
        """This plan with other pool sizes and router replicas (a canary's share)."""
        return replace(
            self,
            prefill=replace(self.prefill, replicas=prefill),
            decode=replace(self.decode, replicas=decode),
            routers=routers,
        )

    @property
    def router_replicas(self) -> int:
        return self.spec.router.replicas if self.routers is None else self.routers

    @property
    def router_name(self) -> str:
        return f"{self.name}-router-{self.revision}"

    @property
    def model_path(self) -> str:
        return self.spec.model.path or self.spec.model.name

    @property
    def served_model_name(self) -> str:
        return self.spec.model.served_model_name or self.spec.model.name

    @property
    def pools(self) -> tuple[PoolPlan, PoolPlan]:
        return (self.prefill, self.decode)
