"""Admission control at the router, sized from the plan (pure).

A fleet offered more than it can serve does not degrade to its capacity: the backlog waits for
decode KV and every later request misses its TTFT (docs/planner.md). So the routers admit what
the plan's pools serve, as far as each router can bound it (below), and answer the rest `429`
at once (`--queue-size 0`), instead of queueing into a backlog that cannot drain.

Data flow: the plan (its pools' instance counts and shapes, the spec's workload and SLO) ->
`sustainable_rate`: the highest request rate at which the planner's model
(`autoscale.model.evaluate`, with the model's instance profile) keeps every queue of these pools
stable (prefill and KV-link utilisation below 1, decode KV fits) -> `Admission`: the fleet's
rate, burst and in-flight bound, and each router's share, which `Admission.limits` turns into
each router's own flags (`desired.resources.router`; a new router template, so the routers
roll, whenever they change: a replica change moves them):
`--rate-limit-tokens-per-second` (the refill of its token bucket, requests per second: an
integer, at least 1), `--max-concurrent-requests` (the bucket's size) and `--queue-size 0`.
What the two routers do with those flags differs (measured on loopback sims,
tests/engine/test_router_admission_real.py):

- smg 1.13 (`router.implementation: smg`): a rate limit and a bound on the requests in flight.
  It admits at most `--max-concurrent-requests` at once (its burst: "bursting up to" it) and
  never holds more in flight; beyond, at the refill rate. So it gets the planner's rate and, as
  its size, `in_flight`: the requests the pools hold before any waits for decode KV (decode KV
  full at the mean context, plus the rate times the TTFT target), never below the burst.
- sglang-router 0.3.2 (the default): its bucket gets a token back when a response ends
  (`--max-concurrent-requests 2 --rate-limit-tokens-per-second 1`: 20 short requests one after
  the other all admitted; 100 long ones over 10 s: 2 + 1 per second in flight), so it does not
  limit the rate: it admits what completes plus the refill. What it bounds is the growth of the
  requests in flight: at most its size, plus its refill per second while it refuses. So in Auto
  it gets `in_flight` as its size and the smallest refill it takes, `ROUTER_032_REFILL`
  (0 means "the size" to it): a bound on what the pools hold that grows by 1 request per
  second per router while the fleet is saturated. A Fixed rate and burst are passed as given.

Why the stable rate and not the (lower) rate the model serves within the SLOs: between the two
the fleet still drains what it admits, with a longer TTFT tail for some requests, and the model
is conservative there: refusing that load cost more goodput than serving it in the planner
benchmark's near-capacity scenarios, while the storm and the output shift, which the limit is
for, did not collapse with either (docs/planner.md, "Admission control").

The request shape is the measured one when the fleet tick has it (prompt and generated tokens
per finished request), else the declared `workload`: a fleet whose outputs grow 4x serves far
fewer requests, and a limit sized for the declared shape would admit the backlog it is meant to
refuse (the planner benchmark's output shift, quick run: 0.96 req/s within SLO with the declared
shape, 4.42 with the measured one). The measured shape is held within a band
(`autoscale.signals.kept_shape`: a length moves when the measured one is over 3% longer or
over 10% shorter),
so the limit, and the routers' template with it, moves only when the shape really changed; a
restarted operator keeps it from `status.admission.requestShape`.

`router.admission.mode`: Auto (the planner's capacity x `headroom`; none without an instance
profile for the model), Fixed (`requestsPerSecond`, `burst`), Off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from cas_operator.api.models import AdmissionMode, CodingAgentServingSpec, RouterImplementation
from cas_operator.autoscale.model import (
    InstanceProfile,
    SloInputs,
    WorkloadInputs,
    evaluate,
)
from cas_operator.autoscale.profiles import load_spec
from cas_operator.desired.plan import Plan
from cas_operator.desired.recommend import instance_profiles, profile_for

BURST_SECONDS = 5.0  # the burst admitted at once: this many seconds of the sustained rate
ROUTER_032_REFILL = 1  # sglang-router 0.3.2's refill in Auto: the least it takes (see above)
SEARCH_STEPS = 14  # bisection steps over the rate (relative precision ~1e-4)


@dataclass(frozen=True)
class RouterLimits:
    """What one router is given: its bucket's refill and size (the flags of the same names)."""

    refill: int  # `--rate-limit-tokens-per-second`
    size: int  # `--max-concurrent-requests`: the burst it admits at once


@dataclass(frozen=True)
class Admission:
    """The fleet's admission limits and each router's share of them."""

    requests_per_second: float  # the fleet's sustained admission rate
    burst: int  # requests the fleet admits at once above it
    in_flight: int  # requests the pools hold before any wait for decode KV (>= burst)
    router_rps: int  # each router's share of the rate (>= 1)
    router_burst: int  # each router's share of the burst
    router_in_flight: int  # each router's share of `in_flight` (>= router_burst)
    basis: str  # where the numbers come from, as status shows it
    fixed: bool = False  # router.admission.mode Fixed: the user's rate and burst, as given

    def limits(self, implementation: RouterImplementation) -> RouterLimits:
        """Each router's flags for `implementation` (the module docstring says why)."""
        if self.fixed:
            return RouterLimits(self.router_rps, self.router_burst)
        if implementation == RouterImplementation.SMG:
            return RouterLimits(self.router_rps, self.router_in_flight)
        return RouterLimits(ROUTER_032_REFILL, self.router_in_flight)

    def to_status(self, routers: int, implementation: RouterImplementation) -> dict[str, object]:
        mine = self.limits(implementation)
        basis = self.basis
        if implementation == RouterImplementation.SGLANG_ROUTER:
            basis += (
                f"; sglang-router 0.3.2 takes a token back when a response ends: each router "
                f"admits {mine.size} at once and what completes, plus {mine.refill}/s while it "
                "refuses"
            )
        return {
            "requestsPerSecond": round(self.requests_per_second, 3),
            "burst": self.burst,
            "inFlight": self.in_flight,
            "perRouter": {
                "requestsPerSecond": mine.refill,
                "burst": mine.size,
                "inFlight": self.router_in_flight,
                "routers": routers,
            },
            "basis": basis,
        }


@dataclass(frozen=True)
class Capacity:
    """What the planner's model says a plan's pools serve."""

    requests_per_second: float  # the highest rate with every queue stable
    in_flight: float  # requests the pools hold before any waits for decode KV (`in_flight_at`)
    basis: str  # how it was found, as status shows it


def per_router(
    rate: float,
    burst: int,
    routers: int,
    basis: str,
    in_flight: float = 0.0,
    *,
    fixed: bool = False,
) -> Admission:
    """Split a fleet's limits over its routers (the entry Service spreads connections)."""
    n = max(1, routers)
    router_rps = max(1, round(rate / n))
    router_burst = max(router_rps, math.ceil(burst / n))
    held = max(burst, math.ceil(in_flight))
    router_held = max(router_burst, math.ceil(held / n))
    return Admission(rate, burst, held, router_rps, router_burst, router_held, basis, fixed)


def admission_for(plan: Plan) -> Admission | None:
    """The limits the plan's routers enforce, or None (mode Off, or Auto without a profile)."""
    spec = plan.spec.router.admission
    routers = plan.router_replicas
    if spec.mode == AdmissionMode.OFF or routers < 1:
        return None
    if spec.mode == AdmissionMode.FIXED:
        assert spec.requests_per_second is not None
        burst = spec.burst or max(1, math.ceil(spec.requests_per_second * BURST_SECONDS))
        return per_router(
            spec.requests_per_second, burst, routers, "fixed: router.admission", fixed=True
        )
    found = planned_capacity(plan)
    if found is None:
        return None
    rate = found.requests_per_second * spec.headroom
    burst = max(1, math.ceil(rate * BURST_SECONDS))
    held = found.in_flight * spec.headroom
    return per_router(rate, burst, routers, f"{found.basis}; x{spec.headroom:g} headroom", held)


def planned_capacity(plan: Plan) -> Capacity | None:
    """What the plan's pools serve, from the model's instance profile; None when the model has
    none."""
    spec = plan.spec
    profile = profile_for(spec.model.name)
    if profile is None:
        return None
    shape = (plan.prefill.shape.tensor_parallel, plan.prefill.shape.context_parallel)
    gpus = (plan.prefill.shape.gpus, plan.decode.shape.gpus)
    return _capacity(
        profile,
        workload_of(spec, plan.measured_shape),
        SloInputs(ttft_s=spec.slo.ttft_seconds, itl_ms=spec.slo.itl_milliseconds),
        shape,
        plan.layer_split,
        gpus,
        plan.prefill.replicas,
        plan.decode.replicas,
    )


def workload_of(
    spec: CodingAgentServingSpec, measured: tuple[float, float] | None = None
) -> WorkloadInputs:
    """The request shape the capacity is searched for (the rate is what the search varies):
    the measured lengths as the autoscale loop keeps them, else the declared ones."""
    inp, out = float(spec.workload.avg_input_tokens), float(spec.workload.avg_output_tokens)
    if measured is not None:  # held within its band already (`autoscale.signals.kept_shape`)
        inp, out = measured
    return WorkloadInputs(
        request_rate=1.0,
        avg_input_tokens=inp,
        avg_output_tokens=out,
        prefix_cache_hit_rate=spec.workload.prefix_cache_hit_rate,
    )


@lru_cache(maxsize=512)
def _capacity(
    profile: str,
    workload: WorkloadInputs,
    slo: SloInputs,
    prefill_tp_cp: tuple[int, int],
    layer_split: bool,
    instance_gpus: tuple[int, int],
    n_prefill: int,
    n_decode: int,
) -> Capacity:
    prefill, decode = instance_profiles(
        load_spec(profile), prefill_tp_cp, layer_split, instance_gpus
    )
    shape = f"{workload.avg_input_tokens:.0f} in/{workload.avg_output_tokens:.0f} out"
    pools = f"{n_prefill}P:{n_decode}D of {profile} at {shape}"
    rate = sustainable_rate(workload, slo, prefill, decode, n_prefill, n_decode)
    within = highest_rate(workload, slo, prefill, decode, n_prefill, n_decode, within_slo=True)
    slo_note = f"within the SLOs to {within:.3g}" if within > 0 else "the SLOs at no rate"
    held = in_flight_at(rate, workload, slo, decode, n_decode)
    basis = f"the planner: {pools} keep queues stable to {rate:.3g} req/s ({slo_note})"
    return Capacity(rate, held, basis)


def in_flight_at(
    rate: float, workload: WorkloadInputs, slo: SloInputs, decode: InstanceProfile, n_decode: int
) -> float:
    """Requests the pools hold at `rate` before any waits for decode KV: each decode instance's
    running requests when its KV is full (at the mean context, prompt plus half the output; at
    most its running-request cap), plus the rate times the TTFT target for those in prefill.
    Not the mean in flight at the rate: a bound there refuses the ordinary fluctuations around
    it (docs/planner.md, "Admission control"). 0 when the pools serve no rate."""
    if rate <= 0 or n_decode < 1:
        return 0.0
    w = workload.resolved()
    context = max(w.avg_input_tokens + w.avg_output_tokens / 2.0, 1.0)
    running = min(float(decode.max_running), decode.kv_capacity_tokens / context)
    return n_decode * running + rate * slo.ttft_s


def sustainable_rate(
    workload: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    n_prefill: int,
    n_decode: int,
) -> float:
    """The admission rate of these pools: the highest at which every queue stays stable."""
    return highest_rate(workload, slo, prefill, decode, n_prefill, n_decode, within_slo=False)


def highest_rate(
    workload: WorkloadInputs,
    slo: SloInputs,
    prefill: InstanceProfile,
    decode: InstanceProfile,
    n_prefill: int,
    n_decode: int,
    *,
    within_slo: bool,
    hit_scale: float = 1.0,
) -> float:
    """The highest request rate the pools serve (bisection; the model is monotone in the rate):
    within the SLOs, or only with every queue stable (utilisations below 1, decode KV fits).
    `hit_scale`: the measured / modelled hit rate (`autoscale.search.hit_scale`), 1 for the
    model as it is."""

    def serves(rate: float) -> bool:
        ev = evaluate(
            WorkloadInputs(**{**workload.__dict__, "request_rate": rate}),
            slo,
            prefill,
            decode,
            n_prefill,
            n_decode,
            hit_scale=hit_scale,
        )
        if within_slo:
            return ev.feasible
        return (
            ev.prefill_util < 1.0 and ev.link_util < 1.0 and ev.kv_ok and math.isfinite(ev.itl_ms)
        )

    lo, hi = 0.0, 1.0
    while serves(hi) and hi < 1e6:
        lo, hi = hi, hi * 2
    if lo == 0.0 and not serves(hi / 1024):
        return 0.0
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if serves(mid) else (lo, mid)
    return lo
