"""Safety properties of the replica controller ``next_replicas`` (Auto mode)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from cas_operator.autoscale.controller import (
    ControlConfig,
    ControlState,
    CurrentReplicas,
    next_replicas,
)
from cas_operator.autoscale.model import Bounds, RatioRecommendation

TICK = 30.0


def _rec(n_p: int, n_d: int) -> RatioRecommendation:
    return RatioRecommendation(
        n_prefill=n_p,
        n_decode=n_d,
        gpus=0,
        ttft_p90_s=1.0,
        itl_ms=10.0,
        hit_rate=0.9,
        goodput_rps=1.0,
        meets_slo=True,
        reason="test",
    )


@dataclass
class World:
    """Pods appear at once (Pending still holds GPUs) and leave ``drain_s`` after scale-down."""

    prefill: int
    decode: int
    drain_s: float
    leaving: list[tuple[float, str]] = field(default_factory=list)

    def pods(self, now: float) -> CurrentReplicas:
        self.leaving = [(t, r) for t, r in self.leaving if t > now]
        lp = sum(1 for _, r in self.leaving if r == "p")
        ld = sum(1 for _, r in self.leaving if r == "d")
        return CurrentReplicas(self.prefill, self.decode, self.prefill + lp, self.decode + ld)

    def apply(self, p: int, d: int, now: float) -> None:
        self.leaving += [(now + self.drain_s, "p")] * max(0, self.prefill - p)
        self.leaving += [(now + self.drain_s, "d")] * max(0, self.decode - d)
        self.prefill, self.decode = p, d


def _run(
    world: World,
    recs: list[tuple[int, int]],
    cfg: ControlConfig,
    ticks_per: int,
    decode_failing: bool = False,
):
    state, now, history = ControlState(), 0.0, []
    for n_p, n_d in recs:
        for _ in range(ticks_per):
            cur = world.pods(now)
            dec = next_replicas(cur, _rec(n_p, n_d), state, now, cfg, decode_failing=decode_failing)
            world.apply(dec.prefill, dec.decode, now)
            state = dec.state
            history.append((now, dec, world.pods(now)))
            now += TICK
    return history


BOUNDS = Bounds(min_prefill=2, max_prefill=40, min_decode=2, max_decode=40, gpu_budget=320)
CAP_320 = Bounds(min_prefill=1, max_prefill=40, min_decode=1, max_decode=40, gpu_budget=320)


def _cfg(bounds: Bounds, **knobs: float) -> ControlConfig:
    """8-GPU instances in both pools, the given bounds and controller knobs."""
    return ControlConfig(prefill_gpus=8, decode_gpus=8, bounds=bounds, **knobs)


CFG = _cfg(BOUNDS, pod_start_s=120.0, down_stable_s=120.0)


@settings(max_examples=60, deadline=None)
@given(
    recs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=8),
    start=st.tuples(st.integers(2, 20), st.integers(2, 20)),
    drain=st.floats(0.0, 400.0),
)
def test_budget_and_floors_hold_for_any_recommendations(recs, start, drain) -> None:
    """Guards budget and floor safety: whatever the planner asks for, GPUs held by existing
    pods (including draining ones) never exceed the budget and replicas stay within bounds."""
    world = World(prefill=start[0], decode=start[1], drain_s=drain)
    for _, dec, pods in _run(world, recs, CFG, ticks_per=12):
        assert (pods.prefill_pods + pods.decode_pods) * 8 <= BOUNDS.gpu_budget
        assert BOUNDS.min_prefill <= dec.prefill <= BOUNDS.max_prefill
        assert BOUNDS.min_decode <= dec.decode <= BOUNDS.max_decode


@settings(max_examples=40, deadline=None)
@given(
    recs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=6),
    start=st.tuples(st.integers(2, 20), st.integers(2, 20)),
    drain=st.floats(0.0, 400.0),
    decode_failing=st.booleans(),
)
def test_failing_decode_rebalance_keeps_budget_floors_and_cooldown(
    recs, start, drain, decode_failing
) -> None:
    """Guards the urgent rebalance: with decode reported failing or not, GPUs of existing pods
    still never exceed the budget, replicas stay within bounds, and the cooldown holds: a
    pool's growth comes at least the pod start time after its last growth, its shrink at least
    that long after its last change (a pool cut a moment ago that is short now may grow), or,
    while decode is failing, a prefill shrink at least `plan_step_s` after prefill's last
    change (the rush to decode cuts through the cooldown, one bounded step at a time)."""
    world = World(prefill=start[0], decode=start[1], drain_s=drain)
    hist = _run(world, recs, CFG, ticks_per=12, decode_failing=decode_failing)
    for _, dec, pods in hist:
        assert (pods.prefill_pods + pods.decode_pods) * 8 <= BOUNDS.gpu_budget
        assert BOUNDS.min_prefill <= dec.prefill <= BOUNDS.max_prefill
        assert BOUNDS.min_decode <= dec.decode <= BOUNDS.max_decode
    for pool in ("prefill", "decode"):
        changes = [
            (t, getattr(dec, pool) - getattr(prev, pool))
            for (_, prev, _), (t, dec, _) in itertools.pairwise(hist)
            if getattr(dec, pool) != getattr(prev, pool)
        ]
        rushed = decode_failing and pool == "prefill"
        for i, (t, step) in enumerate(changes):
            before = [u for u, s in changes[:i] if s > 0 or step < 0]
            gap = CFG.plan_step_s if rushed and step < 0 else CFG.cooldown()
            assert not before or t - before[-1] >= gap, (pool, changes)


@settings(max_examples=40, deadline=None)
@given(
    target=st.tuples(st.integers(2, 25), st.integers(2, 15)),
    start=st.tuples(st.integers(2, 20), st.integers(2, 20)),
)
def test_constant_load_converges_without_oscillation(target, start) -> None:
    """Guards against oscillation: a constant recommendation moves each pool monotonically
    (never up then down) and the fleet stops changing."""
    world = World(prefill=start[0], decode=start[1], drain_s=60.0)
    hist = _run(world, [target], CFG, ticks_per=200)
    for pool in ("prefill", "decode"):
        values = [getattr(dec, pool) for _, dec, _ in hist]
        steps = [b - a for a, b in itertools.pairwise(values) if b != a]
        assert all(s > 0 for s in steps) or all(s < 0 for s in steps)
    tail = [(dec.prefill, dec.decode) for _, dec, _ in hist[-20:]]
    assert len(set(tail)) == 1


def test_cooldown_at_least_pod_start_between_changes() -> None:
    """Guards the cooldown: consecutive changes of one pool are at least the pod start time
    apart, even when the configured cooldown is shorter."""
    cfg = _cfg(bounds=Bounds(max_prefill=100, max_decode=100), pod_start_s=300.0, cooldown_s=10.0)
    world = World(prefill=4, decode=4, drain_s=0.0)
    hist = _run(world, [(40, 40)], cfg, ticks_per=100)
    times = [
        t
        for (t, dec, _), (_, prev, _) in zip(hist[1:], hist, strict=False)
        if dec.prefill != prev.prefill
    ]
    assert len(times) >= 3
    assert all(b - a >= 300.0 for a, b in itertools.pairwise(times))


def test_drain_confirm_then_grow_at_budget_cap() -> None:
    """Guards the rebalance order at the cap: moving from 20P:20D to 28P:12D, prefill grows
    only after the decode pods removed to make room have actually gone."""
    bounds = CAP_320
    cfg = _cfg(bounds=bounds, pod_start_s=60.0, down_stable_s=0.0, max_step_fraction=1.0)
    world = World(prefill=20, decode=20, drain_s=200.0)
    hist = _run(world, [(28, 12)], cfg, ticks_per=40)
    first_decode_down = next(t for t, dec, _ in hist if dec.decode < 20)
    first_prefill_up = next(t for t, dec, _ in hist if dec.prefill > 20)
    assert first_prefill_up >= first_decode_down + 200.0
    assert hist[-1][1].prefill == 28 and hist[-1][1].decode == 12


def test_scale_down_waits_for_stable_lower_target_and_is_bounded() -> None:
    """Guards hysteresis on the way down: a brief dip in the recommendation does not remove
    pods, a lasting one does, one bounded step at a time."""
    cfg = _cfg(bounds=Bounds(), pod_start_s=60.0, down_stable_s=300.0, max_step_fraction=0.25)
    world = World(prefill=20, decode=20, drain_s=0.0)
    hist = _run(world, [(10, 10)] * 1 + [(20, 20)], cfg, ticks_per=5)  # 150 s dip
    assert all(dec.prefill == 20 for _, dec, _ in hist)
    world = World(prefill=20, decode=20, drain_s=0.0)
    hist = _run(world, [(10, 10)], cfg, ticks_per=40)
    values = [dec.prefill for _, dec, _ in hist]
    assert values[-1] == 10
    assert all(a - b <= 5 for a, b in itertools.pairwise(values))
    assert next(i for i, v in enumerate(values) if v < 20) * TICK >= 300.0


def test_rebalance_at_cap_does_not_wait_for_scale_in_stabilisation() -> None:
    """Guards rebalancing at the budget cap: when decode must grow and prefill must shrink to
    make room, the prefill step is taken at once (not after down_stable_s), and decode grows
    only after the removed prefill pods are gone."""
    bounds = CAP_320
    cfg = _cfg(bounds=bounds, pod_start_s=60.0, down_stable_s=3600.0, max_step_fraction=0.25)
    world = World(prefill=30, decode=10, drain_s=90.0)
    hist = _run(world, [(24, 16)], cfg, ticks_per=60)
    first_p_down = next(t for t, dec, _ in hist if dec.prefill < 30)
    first_d_up = next(t for t, dec, _ in hist if dec.decode > 10)
    assert first_p_down < 3600.0
    assert first_d_up >= first_p_down + 90.0
    assert hist[-1][1].prefill == 24 and hist[-1][1].decode == 16


def test_small_pool_takes_what_the_large_one_released_in_one_step() -> None:
    """Regression (simulator: output-length shift at the cap): decode's step up was bounded by
    25% of its own small size (8 -> 10), so taking over the 6 instances prefill released took
    three cooldowns. A step up is now bounded by 25% of the fleet: decode grows by what the
    prefill drain freed at once, and never past the budget."""
    bounds = Bounds(min_prefill=1, max_prefill=31, min_decode=1, max_decode=31, gpu_budget=256)
    cfg = _cfg(bounds=bounds, pod_start_s=600.0, down_stable_s=600.0, max_step_fraction=0.25)
    world = World(prefill=24, decode=8, drain_s=60.0)
    hist = _run(world, [(17, 15)], cfg, ticks_per=30)
    decodes = [dec.decode for _, dec, _ in hist]
    first_up = next(d for d in decodes if d > 8)
    assert first_up - 8 > 2  # more than 25% of the decode pool itself
    assert first_up - 8 <= 8  # at most 25% of the 32-instance fleet
    assert all(dec.prefill * 8 + dec.decode * 8 <= 256 for _, dec, _ in hist)


def test_failing_decode_takes_the_rebalance_without_the_stability_wait() -> None:
    """Regression (simulator: budget-capped rebalance, reading -> writing shift at the cap): the
    decode pool was full with hundreds of requests waiting for KV, the slow loop asked for
    21P:7D -> 15P:13D, and the prefill step still waited ``rebalance_stable_s`` (300 s) before
    the drain-then-grow could start. With decode reported failing the prefill step is taken on
    the first tick; decode still grows only after the removed prefill pods are gone, and
    without the failing signal the wait is kept."""
    bounds = Bounds(min_prefill=1, max_prefill=27, min_decode=1, max_decode=27, gpu_budget=224)
    cfg = _cfg(bounds=bounds, pod_start_s=600.0, down_stable_s=900.0, max_step_fraction=0.25)
    hist = _run(World(21, 7, drain_s=60.0), [(15, 13)], cfg, ticks_per=30, decode_failing=True)
    first_p_down = next(t for t, dec, _ in hist if dec.prefill < 21)
    first_d_up = next(t for t, dec, _ in hist if dec.decode > 7)
    assert first_p_down == 0.0
    assert first_d_up >= first_p_down + 60.0
    assert (hist[-1][1].prefill, hist[-1][1].decode) == (15, 13)
    calm = _run(World(21, 7, drain_s=60.0), [(15, 13)], cfg, ticks_per=30)
    assert next(t for t, dec, _ in calm if dec.prefill < 21) >= cfg.rebalance_stable_s


def test_failing_decode_does_not_skip_the_deadband() -> None:
    """Guards against churn at the cap: a one-instance rebalance target on a 21-instance
    prefill pool (inside its deadband) is not rushed while decode reports failing, so a
    stale slow-loop target cannot start a cooldown that blocks the real rebalance; it waits
    out the rebalance hold like any other."""
    bounds = Bounds(min_prefill=1, max_prefill=27, min_decode=1, max_decode=27, gpu_budget=224)
    cfg = _cfg(bounds=bounds, pod_start_s=600.0, down_stable_s=900.0)
    hist = _run(World(21, 7, drain_s=60.0), [(20, 8)], cfg, ticks_per=20, decode_failing=True)
    early = [dec for now, dec, _ in hist if now < cfg.rebalance_stable_s]
    assert early and all((dec.prefill, dec.decode) == (21, 7) for dec in early)


def test_at_the_cap_a_held_target_inside_the_deadband_still_rebalances() -> None:
    """Regression (real sessions, the Mooncake-shaped scenario): plans of 24-26 prefill at a
    27P:5D cap, mostly one instance below (inside prefill's deadband), reset the lower target's
    hold at every such plan, so decode never grew for half an hour. A lower target held for
    the rebalance hold is taken at the cap, inside the deadband too; off the cap the deadband
    still blocks a scale-in."""
    bounds = Bounds(min_prefill=1, max_prefill=31, min_decode=1, max_decode=31, gpu_budget=256)
    cfg = _cfg(bounds=bounds, pod_start_s=600.0, down_stable_s=900.0)
    plans = [(26, 6), (24, 8), (26, 6), (26, 6), (25, 7), (26, 6)]
    hist = _run(World(27, 5, drain_s=60.0), plans, cfg, ticks_per=4)
    assert min(dec.prefill for _, dec, _ in hist) < 27
    assert max(pods.decode for _, _, pods in hist) > 5
    off_cap = _cfg(bounds=replace(bounds, gpu_budget=None), pod_start_s=600.0)
    hist = _run(World(27, 5, drain_s=60.0), [(26, 5)], off_cap, ticks_per=60)
    assert all(dec.prefill == 27 for _, dec, _ in hist)


def test_a_first_lower_target_after_a_quiet_spell_waits_out_the_rebalance_hold() -> None:
    """Regression (real sessions behind consistent hashing, bench.planner_traces): a plan
    equal to the running split started the lower target's hold clock, so after a quiet spell
    at 27P:5D the first noisy plan for 26P:6D was taken at once as a rebalance, and the next
    window's plan moved it back. The hold now starts at the first lower target: a plan that
    keeps asking for the move rebalances after `rebalance_stable_s`, one that flips back to
    the running split in between never does."""
    bounds = Bounds(min_prefill=1, max_prefill=31, min_decode=1, max_decode=31, gpu_budget=256)
    cfg = _cfg(bounds=bounds, pod_start_s=600.0, down_stable_s=900.0)
    quiet = [(27, 5)] * 4
    hist = _run(World(27, 5, drain_s=60.0), [*quiet, *[(26, 6)] * 3], cfg, ticks_per=10)
    moved = next(t for t, dec, _ in hist if dec.prefill < 27)
    assert moved - 4 * 10 * TICK >= cfg.rebalance_stable_s
    flipping = [*quiet, (26, 6), (27, 5)] * 3  # the move asked for 240 s at a time
    hist = _run(World(27, 5, drain_s=60.0), flipping, cfg, ticks_per=8)
    assert all((dec.prefill, dec.decode) == (27, 5) for _, dec, _ in hist)


# ------------------------------------------ cooldown by direction (issue 18, the output shift)

SHIFT = _cfg(Bounds(max_prefill=31, max_decode=31, gpu_budget=256), pod_start_s=600.0)


def test_a_pool_cut_a_moment_ago_grows_at_once_when_short() -> None:
    """Regression (planner benchmark, output shift): decode had shrunk 7 -> 6 at t=750 on the
    old load; at the shift (t=930) the plan asked for 10 and decode stayed at 6 for 600 s, the
    cooldown of its shrink, with its KV full. A growth waits only on the last growth."""
    state = ControlState(last_decode_change=750.0, last_prefill_change=-1e9)
    dec = next_replicas(CurrentReplicas(20, 6, 20, 6), _rec(20, 10), state, 930.0, SHIFT)
    assert dec.decode > 6
    grew = ControlState(last_decode_change=750.0, last_decode_growth=750.0)
    held = next_replicas(CurrentReplicas(20, 6, 20, 6), _rec(20, 10), grew, 930.0, SHIFT)
    assert held.decode == 6 and "decode cooldown" in held.reason


def test_a_lower_target_starts_its_hold_clock_during_a_cooldown() -> None:
    """Regression: a plan for less prefill that arrived during prefill's cooldown only started
    its `down_stable_s` clock when the cooldown ended, so the shrink came a cooldown late."""
    state = ControlState(last_prefill_change=750.0, last_prefill_growth=750.0)
    dec = next_replicas(CurrentReplicas(25, 6, 25, 6), _rec(13, 6), state, 930.0, SHIFT)
    assert dec.prefill == 25 and dec.state.down_since_prefill == 930.0


def test_growth_toward_the_plan_goes_on_in_paced_steps_during_a_cooldown() -> None:
    """The slow loop's plan (which does not read the starting pods' signals) is followed in
    bounded steps `plan_step_s` apart; what the fast loop adds above it waits for the cooldown."""
    grew = ControlState(last_decode_change=1000.0, last_decode_growth=1000.0)
    cur = CurrentReplicas(12, 8, 12, 8)
    early = next_replicas(
        cur, _rec(12, 20), grew, 1000.0 + SHIFT.plan_step_s - 1, SHIFT, planned=(12, 20)
    )
    assert early.decode == 8
    step = next_replicas(
        cur, _rec(12, 20), grew, 1000.0 + SHIFT.plan_step_s, SHIFT, planned=(12, 20)
    )
    assert 8 < step.decode <= 8 + 5  # one bounded step: 25% of the fleet (20 instances)
    nudge = next_replicas(cur, _rec(12, 9), grew, 1200.0, SHIFT, planned=(12, 8))
    assert nudge.decode == 8  # the fast loop's +1 above the plan waits for the cooldown


def test_the_rush_to_decode_cuts_through_a_prefill_cooldown_one_step_at_a_time() -> None:
    """Regression (output shift): prefill had grown at t=750, so at t=930, with decode
    saturated and the plan at 13P:19D, prefill kept 25 instances until t=1350 and decode could
    not grow at the cap. The rush now takes prefill's step after `plan_step_s`."""
    state = ControlState(last_prefill_change=750.0, last_prefill_growth=750.0)
    cur = CurrentReplicas(25, 7, 25, 7)
    dec = next_replicas(cur, _rec(13, 19), state, 930.0, SHIFT, decode_failing=True)
    assert 13 <= dec.prefill < 25 and dec.decode == 7  # decode grows once the pods are gone
    again = next_replicas(
        CurrentReplicas(dec.prefill, 7, 25, 7), _rec(13, 19), dec.state, 960.0, SHIFT,
        decode_failing=True,
    )  # fmt: skip
    assert again.prefill == dec.prefill  # the next step waits plan_step_s
    calm = next_replicas(cur, _rec(13, 19), state, 930.0, SHIFT)
    assert calm.prefill == 25  # without the rush the cooldown holds


def test_room_freed_at_the_cap_goes_to_the_plan_before_a_fast_loop_raise() -> None:
    """Regression (issue 39, bench.planner_traces' Mooncake-shaped surge): at a 256-GPU cap the
    plan asked for 26P:6D from 27P:5D; once a prefill pod had gone, the fast loop's raise of
    prefill (its TTFT p90 over the SLO, as on real sessions at every split) asked for 27P:6D,
    and the budget's room went to prefill first: back to 27P:5D, for the whole run. Growth
    toward the slow loop's plan now takes the room before growth beyond it."""
    cfg = _cfg(
        Bounds(max_prefill=31, max_decode=31, gpu_budget=256), pod_start_s=600.0, cooldown_s=0.0
    )
    cur = CurrentReplicas(prefill=26, decode=5, prefill_pods=26, decode_pods=5)
    dec = next_replicas(cur, _rec(27, 6), ControlState(), 1000.0, cfg, planned=(26, 6))
    assert (dec.prefill, dec.decode) == (26, 6)
    # without a plan to favour, as before: the room goes to prefill first
    dec = next_replicas(cur, _rec(27, 6), ControlState(), 1000.0, cfg)
    assert (dec.prefill, dec.decode) == (27, 5)
