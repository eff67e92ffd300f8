"""How one pass splits a fleet between its revisions during a canary rollout (pure).

Input: the plan (the pools' full sizes, the spec), the rollout state (`rollout.state`: which
revision is stable, which is the canary, the step and the weight in effect) and the revisions
that exist. Output: a `Split`, which the reconcile applies:
- which revisions stay (`keep`; every other one retires through the drain path);
- the sizes of the current revision's pools and routers (the canary's: the step's weight of
  the full pools at the planner's P:D, at least one instance per role) and of the stable
  revision's (the full pools; fewer when both revisions would pass `ratio.gpuBudget` plus
  `rollout.maxSurgeGpus` (`surge_limit`), the stable pools then shrinking through the
  scale-down loop, which drains before it removes);
- how traffic is split: with `spec.gateway`, HTTPRoute weights on the Services
  `<name>-stable` and `<name>-canary` (exact, per request); without, the entry Service
  `<name>` selects both revisions' routers and the split follows their replica counts
  (`router_split`), which needs every other revision's router gone first. kube-proxy balances
  connections, not requests: a client that keeps its connection alive stays on the router it
  reached first, so that split holds for new connections only.
An aborted canary (`state.aborted` == the spec's revision) builds none of its children: the
stable revision serves alone until the spec changes or the user retries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cas_operator.desired.plan import Plan
from cas_operator.rollout.decide import target_weight
from cas_operator.rollout.state import Phase, RolloutState

MODE_GATEWAY = "HTTPRoute"
MODE_SERVICE = "Service"
# Without a Gateway the split follows router replicas: at most this many routers of both
# revisions together (or twice router.replicas, if more), which gives 10% steps.
SPLIT_ROUTERS = 10


@dataclass(frozen=True)
class Sizes:
    """Instances of each pool and router replicas of one revision."""

    prefill: int
    decode: int
    routers: int

    def gpus(self, plan: Plan) -> int:
        return self.prefill * plan.prefill.shape.gpus + self.decode * plan.decode.shape.gpus


@dataclass(frozen=True)
class Split:
    """What one pass renders for a rollout (see the module docstring)."""

    current: str  # the spec's revision
    stable: str  # the revision users are served by
    canary: str | None  # the spec's revision while it runs as a canary
    weight: int  # the canary's share of requests, in effect (percent)
    build_current: bool  # False: the spec's revision was aborted; none of its children exist
    current_sizes: Sizes
    stable_sizes: Sizes | None  # the stable revision's, while it is not the spec's
    entry: str | None  # the revision the entry Service selects (None: stable's and canary's)
    mode: str
    precision: str  # how exact the split is, as status shows it
    keep: frozenset[str]
    waiting: str = ""  # why the split cannot take effect yet
    sized_step: int | None = None  # the canary step `current_sizes` are for
    # just promoted: the Gateway's weight stays on `<name>-canary` (it already selects the
    # new revision) while `<name>-stable`'s endpoints follow its new selector
    settling: bool = False

    @property
    def route_weight(self) -> int:
        """The canary Service's share of the Gateway's requests (the HTTPRoute's weight)."""
        if self.settling:  # both Services select the promoted revision; `-stable` settling
            return 100
        return self.weight if self.canary is not None and not self.waiting else 0

    @property
    def serving(self) -> frozenset[str]:
        """The revisions that receive requests."""
        if self.canary is not None and self.weight > 0 and not self.waiting:
            return frozenset({self.stable, self.canary})
        return frozenset({self.stable})


def canary_pools(plan: Plan, weight: int) -> tuple[int, int]:
    """The canary's instances per role for `weight`: that share of the full pools, rounded
    up, at least one each (a canary of one role cannot serve a PD request)."""
    if weight >= 100:
        return plan.prefill.replicas, plan.decode.replicas
    return tuple(  # type: ignore[return-value]
        max(1, math.ceil(n * weight / 100)) for n in (plan.prefill.replicas, plan.decode.replicas)
    )


def fit(plan: Plan, wanted: tuple[int, int], room: int) -> tuple[int, int]:
    """The largest pools no bigger than `wanted` within `room` GPUs, shrinking the role that
    is furthest above its share of `wanted` first; never below one instance each."""
    gp, gd = plan.prefill.shape.gpus, plan.decode.shape.gpus
    p, d = wanted
    while p * gp + d * gd > room and (p > 1 or d > 1):
        if d <= 1 or (p > 1 and p / wanted[0] >= d / wanted[1]):
            p -= 1
        else:
            d -= 1
    return p, d


def surge_limit(plan: Plan, full_gpus: int) -> int | None:
    """The most GPUs both revisions of a canary may hold: `ratio.gpuBudget` (or the full
    pools, without one) plus `rollout.maxSurgeGpus` (0 when unset); None with neither set
    (the canary then runs on top of the stable pools)."""
    budget, surge = plan.spec.ratio.gpu_budget, plan.spec.rollout.max_surge_gpus
    if budget is None and surge is None:
        return None
    return (budget or full_gpus) + (surge or 0)


def router_split(weight: int, base: int) -> tuple[int, int]:
    """(stable, canary) router replicas whose ratio is closest to `weight`% for the canary,
    each at least one, together at most max(SPLIT_ROUTERS, 2 x base); on ties the stable
    revision keeps at least `base` routers if it can, then the fewest routers."""
    total = max(SPLIT_ROUTERS, 2 * base)
    pairs = [(n - canary, canary) for n in range(2, total + 1) for canary in range(1, n)]

    def rank(pair: tuple[int, int]) -> tuple[float, bool, int]:
        stable, canary = pair
        error = round(abs(canary / (stable + canary) - weight / 100), 9)
        return error, stable < base, stable + canary

    return min(pairs, key=rank)


def split_for(plan: Plan, state: RolloutState, others: frozenset[str]) -> Split:
    """The split of one pass; `others` are the revisions that exist besides the spec's and
    the stable one (older canaries, revisions still retiring)."""
    current, routers = plan.revision, plan.spec.router.replicas
    full = Sizes(plan.prefill.replicas, plan.decode.replicas, routers)
    stable = state.stable or current
    gateway = plan.spec.gateway is not None
    mode = MODE_GATEWAY if gateway else MODE_SERVICE
    if state.canary is None or state.canary != current:
        aborted = state.phase == Phase.ABORTED and state.aborted == current and stable != current
        if not aborted:  # no canary: the spec's revision is (or becomes) the stable one
            replaced = state.replaced if state.replaced not in (None, current) else None
            keep = frozenset({current} | ({replaced} if replaced else set()))
            return Split(current, current, None, 0, True, full, None, current, mode, "", keep,
                         settling=replaced is not None)  # fmt: skip
        return Split(
            current, stable, None, 0, False, full, full, stable, mode, "", frozenset({stable})
        )
    size_weight = target_weight(plan.spec.rollout.steps or [], state.step)
    canary_p, canary_d = canary_pools(plan, size_weight)
    stable_p, stable_d = full.prefill, full.decode
    limit = surge_limit(plan, full.gpus(plan))
    if limit is not None:
        minimum = plan.prefill.shape.gpus + plan.decode.shape.gpus
        canary_p, canary_d = fit(plan, (canary_p, canary_d), limit - minimum)
        canary_gpus = canary_p * plan.prefill.shape.gpus + canary_d * plan.decode.shape.gpus
        stable_p, stable_d = fit(plan, (stable_p, stable_d), limit - canary_gpus)
    stable_routers, canary_routers = routers, routers
    entry: str | None = stable
    waiting, precision, weight = "", "exact (HTTPRoute weights)", state.weight
    if not gateway and 0 < weight < 100:
        if others:
            waiting = f"the split waits for revision {', '.join(sorted(others))} to retire"
        else:
            stable_routers, canary_routers = router_split(weight, max(routers, 1))
            entry = None
        share = canary_routers / (stable_routers + canary_routers)
        precision = (
            f"{canary_routers} of {stable_routers + canary_routers} routers ({share:.0%} of "
            "new connections)"
        )
    elif not gateway:
        entry = current if weight >= 100 else stable
        precision = "whole revisions (entry Service)"
    return Split(
        current=current,
        stable=stable,
        canary=current,
        weight=weight,
        build_current=True,
        current_sizes=Sizes(canary_p, canary_d, canary_routers),
        stable_sizes=Sizes(stable_p, stable_d, stable_routers),
        entry=entry,
        mode=mode,
        precision=precision,
        keep=frozenset({stable, current}),
        waiting=waiting,
        sized_step=state.step,
    )


def single_revision(plan: Plan, serving: str | None) -> Split:
    """The split of a fleet without a canary (a Rolling fleet, or `cas-operator render`): both
    traffic Services on the revision that serves (`serving`, else the spec's), all weight on
    the stable one."""
    revision = serving or plan.revision
    sizes = Sizes(plan.prefill.replicas, plan.decode.replicas, plan.router_replicas)
    mode = MODE_GATEWAY if plan.spec.gateway is not None else MODE_SERVICE
    return Split(
        plan.revision,
        revision,
        None,
        0,
        True,
        sizes,
        None,
        serving,
        mode,
        "",
        frozenset({revision}),
    )
