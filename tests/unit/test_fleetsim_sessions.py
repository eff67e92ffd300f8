"""The fleet simulator on real sessions (bench.fleetsim.sessions and the simulator's
`sessions=` mode; issue 39, part 3).

Guards: real requests replayed in closed loop (a request's successor leaves its think time
after the answer ends on the simulated fleet, a subagent after the parent request that spawned
it); sglang-router's cache-aware routing (a returning turn goes back to the instance holding its
prefix, a new session to the least-filled instance); the keyed policies (smg's consistent
hashing: one instance per session, about 1/N of the sessions moved by a scale step;
sglang-router's manual: a map per router pod; decodes in turn behind both, each request
waiting on its own); the prefill engines' reuse measurement,
which must be what `cas_engine.prefixreuse` exports for the same routed requests; and the
planner's operator-fed loop reading it."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from bench.fleetsim import FleetConfig, SessionMix, SessionWorkload
from bench.fleetsim.engine import (
    CacheAwareRouting,
    ConsistentHashRouting,
    ManualRouting,
    Routing,
    Simulator,
)
from bench.fleetsim.policies import RatioPlannerPolicy
from bench.fleetsim.sessions import Placement, SessionTraffic, SimSession
from bench.traces import parse_claude_session
from cas_engine.prefixreuse import REUSE_BUCKETS_S, ReuseTracker
from cas_operator.api.models import WorkloadSpec
from cas_operator.autoscale import profiles as pf
from cas_operator.autoscale.model import Bounds, SloInputs

SPEC = pf.load_spec("glm5-fp8-h200")
P = pf.prefill_profile(SPEC)
D = pf.decode_profile(SPEC)


def _doc(key: str, turns: int, seed: int, subagent: bool = False) -> dict[str, Any]:
    """A session whose prompt grows by a few blocks a turn (sometimes cut back: compaction),
    think times of 5-40 s, optionally a subagent spawned after its second request."""
    rng = np.random.default_rng(seed)
    chain, next_id, t, reqs = list(range(1, 40)), 1000, 0.0, []
    for k in range(turns):
        if k and rng.random() < 0.15:
            chain = chain[: len(chain) // 2]
        grow = int(rng.integers(2, 30))
        chain = chain + list(range(next_id, next_id + grow))
        next_id += grow
        think = float(rng.uniform(5.0, 40.0)) if k else 0.0
        t += think + (3.0 if k else 0.0)
        reqs.append(
            {"t": t, "type": "n", "in": 64 * len(chain) + 17, "out": int(rng.integers(20, 300)),
             "hash_ids": list(chain), "think_time": think, "api_time": 3.0}
        )  # fmt: skip
        if subagent and k == 1:
            sub = [1, 2, 3, 5000, 5001]
            reqs.append(
                {"t": t + 4.0, "type": "subagent", "agent_id": "a",
                 "requests": [
                     {"t": 0.0, "in": 64 * len(sub), "out": 30, "hash_ids": sub},
                     {"t": 6.0, "in": 64 * 6 + 9, "out": 30, "hash_ids": [*sub, 5002],
                      "think_time": 4.0},
                 ]}
            )  # fmt: skip
    return {"id": key, "block_size": 64, "requests": reqs}


def _sessions(n: int) -> list[SimSession]:
    return [
        SimSession.of(parse_claude_session(_doc(f"s{i}", 6 + i % 5, i, i == 0))) for i in range(n)
    ]


def _cfg(n_p: int, n_d: int, duration: float, **kw: Any) -> FleetConfig:
    return FleetConfig(
        prefill=P, decode=D, n_prefill=n_p, n_decode=n_d, max_prefill=n_p, max_decode=n_d,
        duration_s=duration, seed=1, **kw,
    )  # fmt: skip


class _Logged(Simulator):
    """The simulator with every routed request logged: (time, instance, placement, request)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.log: list[tuple[float, int, str, int, int]] = []

    def _route(self, step, scope, trie, leaf, blocks, inp, now, ready, routed):  # type: ignore[no-untyped-def]
        out = super()._route(step, scope, trie, leaf, blocks, inp, now, ready, routed)
        self.log.append((now, out[0], scope, leaf, blocks))
        return out


def test_requests_leave_their_think_time_after_the_answer_on_the_fleet() -> None:
    """Closed loop: every request after a session's first is released its trace think time
    after its predecessor's answer ended in the simulation, not at its trace time; the
    subagent's first request follows the parent request before it."""
    sessions = _sessions(3)
    traffic = SessionTraffic(sessions, [Placement(1.0 + 5.0 * i, i) for i in range(3)])
    sim = _Logged(_cfg(2, 1, 900.0, prepopulate=False), sessions=traffic)
    res = sim.run()
    done = sum(len(s.input_tokens) for s in sessions)
    assert len(res.arrival) == done
    end = res.arrival + res.ttft + res.itl * np.maximum(res.output_tokens - 1, 1)
    s0 = sessions[0]
    order = np.argsort(res.arrival)
    first = order[0]
    assert res.arrival[first] == pytest.approx(1.0)
    # session 0's second request: released think_s after its first answer ended
    second = next(k for k in order if k != first and res.input_tokens[k] == s0.input_tokens[1])
    assert res.arrival[second] == pytest.approx(end[first] + s0.think_s[1], abs=0.6)
    # the subagent's first request is released after session 0's second request was answered
    sub_first = int(s0.first[1])
    sub = next(k for k in order if res.input_tokens[k] == s0.input_tokens[sub_first])
    assert res.arrival[sub] >= end[second] - 0.6


def test_returning_turns_go_home_and_new_sessions_to_the_least_filled_instance() -> None:
    """The product's cache-aware routing: a session's later turns land on the instance that
    cached its earlier ones (their prefix covers far more than 30% of the prompt), and a new
    session's first turn on the instance holding the fewest blocks."""
    sessions = _sessions(6)
    traffic = SessionTraffic(sessions, [Placement(2.0 * i, i) for i in range(6)])
    sim = _Logged(_cfg(3, 2, 900.0, prepopulate=False), sessions=traffic)
    res = sim.run()
    homes: dict[str, set[int]] = {}
    for _, inst, scope, _, _ in sim.log:
        if "/" not in scope.split("@")[0]:
            homes.setdefault(scope, set()).add(inst)
    assert all(len(h) == 1 for h in homes.values()), homes
    firsts = [inst for (_, inst, scope, _, _) in sim.log[:3]]
    assert sorted(firsts) == [0, 1, 2]  # three new sessions spread over the empty instances
    assert res.goodput(3.0, 50.0)["hit_rate"] > 0.5


def _homes(log: list[tuple[float, int, str, int, int]]) -> dict[str, set[int]]:
    """The instances each session's requests landed on."""
    homes: dict[str, set[int]] = {}
    for _, inst, scope, _, _ in log:
        homes.setdefault(scope, set()).add(inst)
    return homes


def test_consistent_hashing_keeps_each_session_on_one_instance() -> None:
    """smg's `consistent_hashing` (the default router for real coding-agent traffic): every
    request of a session, subagents included, lands on the instance its key hashes to,
    whatever that instance caches or holds; the sessions spread over the instances."""
    sessions = _sessions(12)
    traffic = SessionTraffic(sessions, [Placement(2.0 * i, i) for i in range(12)])
    cfg = _cfg(4, 2, 900.0, prepopulate=False, routing=ConsistentHashRouting())
    sim = _Logged(cfg, sessions=traffic)
    res = sim.run()
    homes = _homes(sim.log)
    assert len(homes) == 12 and all(len(h) == 1 for h in homes.values()), homes
    ring = {k: sim._ring_owner(cfg.routing, k, np.arange(4)) for k in homes}  # type: ignore[arg-type]
    assert {k: h.pop() for k, h in homes.items()} == ring
    assert len(set(ring.values())) >= 3  # not all on one instance
    assert res.goodput(3.0, 50.0)["hit_rate"] > 0.5


def _owners(sim: Simulator, rt: ConsistentHashRouting, ready: list[int]) -> np.ndarray:
    return np.array([sim._ring_owner(rt, f"k{j}@{j}", np.array(ready)) for j in range(3000)])


def test_a_scale_step_moves_only_the_sessions_of_the_added_or_removed_instance() -> None:
    """The ring's point of keyed routing: adding a ninth instance moves about 1/9 of the
    sessions, all of them to it (each re-prefills once), where cache-aware routing sends it
    every new session until its cache fills; removing one moves only its own sessions. 150
    points per instance keep the shares within a few points of even."""
    rt = ConsistentHashRouting()
    sessions = _sessions(1)
    cfg = _cfg(9, 1, 10.0, prepopulate=False, routing=rt)
    sim = Simulator(cfg, sessions=SessionTraffic(sessions, [Placement(0.0, 0)]))
    eight = _owners(sim, rt, list(range(8)))
    shares = np.bincount(eight, minlength=8) / eight.size
    assert shares.min() > 0.08 and shares.max() < 0.17, shares
    nine = _owners(sim, rt, list(range(9)))
    moved = nine != eight
    assert set(nine[moved].tolist()) == {8}
    assert 0.07 < moved.mean() < 0.16
    without_3 = _owners(sim, rt, [0, 1, 2, 4, 5, 6, 7])
    assert np.array_equal(without_3 != eight, eight == 3)


def test_manual_routing_keeps_a_map_per_router_pod() -> None:
    """sglang-router 0.3.2's `manual` (its default under this operator): each router pod maps a
    session to a random instance of its own, so behind two pods a session's requests land on up
    to two instances (its prefix cached twice), behind one on exactly one."""
    sessions = _sessions(10)
    for pods, most in ((1, 1), (2, 2)):
        traffic = SessionTraffic(sessions, [Placement(2.0 * i, i) for i in range(10)])
        cfg = _cfg(6, 2, 900.0, prepopulate=False, routing=ManualRouting(pods))
        sim = _Logged(cfg, sessions=traffic)
        sim.run()
        spread = [len(h) for h in _homes(sim.log).values()]
        assert max(spread) == most, spread
    assert spread.count(2) >= 5  # behind two pods most sessions were split


def test_synthetic_sessions_follow_the_ring_and_what_keyed_routing_refuses() -> None:
    """Synthetic sessions carry an id of their own (a reused slot gets a new one), so
    consistent hashing places them as it places real ones: every turn on the ring's owner of
    the session's id, a returning turn a hit only there. `manual` needs real sessions (it
    caches a session twice, which the session-level caches cannot hold), and an open-loop trace
    carries no key: both are refused, not ignored."""
    rt = ConsistentHashRouting()
    wl = SessionWorkload(SessionMix(session_rate=0.2), seed=1)
    sim = Simulator(_cfg(4, 2, 600.0, routing=rt), workload=wl)
    routed: list[tuple[int, int]] = []
    route = sim._route_sessions

    def logged(*args: Any) -> Any:
        inst, hit = route(*args)
        routed.extend(zip(args[-1].tolist(), inst.tolist(), strict=True))
        return inst, hit

    sim._route_sessions = logged  # type: ignore[method-assign]
    hit = sim.run().goodput(3.0, 50.0)["hit_rate"]
    aware = Simulator(_cfg(4, 2, 600.0), workload=wl).run().goodput(3.0, 50.0)["hit_rate"]
    assert len(routed) > 100 and hit > 0.9 * aware  # (caches start cold: both are low here)
    ready = np.arange(4)
    assert all(inst == sim._ring_owner(rt, f"s{key}", ready) for key, inst in routed)
    assert len({key for key, _ in routed}) > len({inst for _, inst in routed})
    with pytest.raises(ValueError, match="manual routing needs real sessions"):
        Simulator(_cfg(2, 1, 60.0, routing=ManualRouting()), workload=wl)


def _tokens(scope: str, ids: list[int], total: int) -> list[int]:
    """A prompt with the block structure of ``ids``: each (session, block id) its own 64
    tokens, then a fresh tail."""
    root = scope.split("@")[1]
    out: list[int] = []
    for b in ids:
        seed = zlib.crc32(f"{root}:{b}".encode())
        out += np.random.default_rng(seed).integers(1, 50_000, 64).tolist()
    return out + list(range(100_000, 100_000 + total - len(out)))


def test_the_engines_reuse_measurement_is_cas_engines() -> None:
    """Every prefill instance's exported prompt reuse (`Metrics.reuse` summed over the run)
    equals what `cas_engine.prefixreuse.ReuseTracker` (every block tracked) exports when fed
    the same requests in the same order on each instance, on the simulated clock."""
    sessions = _sessions(6)
    traffic = SessionTraffic(sessions, [Placement(3.0 * i, i) for i in range(6)])
    sim = _Logged(_cfg(2, 2, 600.0, prepopulate=False, evict_every_s=1.0), sessions=traffic)
    sim.run()
    clock = [0.0]
    trackers = [ReuseTracker(sample_rate=1, clock=lambda: clock[0]) for _ in range(2)]
    hist = np.zeros(len(REUSE_BUCKETS_S) + 1)
    first_seen = requests = 0
    by_scope = {traffic.scope(k): traffic.session(k) for k in range(len(traffic.placements))}
    for now, inst, scope, leaf, blocks in sim.log:
        s = by_scope[scope]
        req = next(r for r in range(len(s.leaf)) if s.leaf[r] == leaf and s.blocks[r] == blocks)
        ids = _path(s, req)
        clock[0] = now
        got = trackers[inst].observe(_tokens(scope, ids, int(s.input_tokens[req])))
        for gap in got.reuse_s:
            hist[np.searchsorted(REUSE_BUCKETS_S, gap, side="left")] += got.block_tokens
        first_seen += got.first_seen_tokens
        requests += 1
    total = sim.reuse_bins.sum(axis=0)
    assert hist.sum() > 0 and np.count_nonzero(hist) > 3  # reuses over several buckets
    assert np.allclose(total, hist)
    assert sim.bins["first_seen"].sum() == first_seen
    assert sim.bins["tracked"].sum() == requests


def _path(s: SimSession, request: int) -> list[int]:
    """The block ids of a request's prompt, from the session's trie."""
    node, out = int(s.leaf[request]), []
    while node:
        out.append(node)
        node = s.trie.parent[node]
    return out[::-1]


def test_the_operator_fed_planner_reads_the_engines_reuse_times() -> None:
    """`ours` on real sessions plans with the measured reuse histogram (quantised as the
    operator's) in its workload, so the model draws its hit-rate curve from it."""
    sessions = _sessions(6)
    traffic = SessionTraffic(sessions, [Placement(2.0 * i, i) for i in range(6)])
    seen: list[Any] = []
    policy = RatioPlannerPolicy(
        P, D, SloInputs(3.0, 50.0), Bounds(max_prefill=3, max_decode=3), start_s=60.0,
        operator_inputs=WorkloadSpec.model_validate(
            {"avgInputTokens": 5000, "avgOutputTokens": 200}
        ),
    )  # fmt: skip
    plan = policy._workload

    def spy(m: Any, rate: float, rate_cv: float | None = None) -> Any:
        wl = plan(m, rate, rate_cv)
        seen.append(wl)
        return wl

    policy._workload = spy  # type: ignore[method-assign]
    Simulator(_cfg(2, 2, 400.0, prepopulate=False), policy=policy, sessions=traffic).run()
    assert seen and all(wl.reuse is not None for wl in seen)
    assert seen[-1].reuse.reused[-1][1] > 0.0  # blocks seen before were measured


def _waiting(sim: Simulator, inputs: list[float], placed: list[int], ready_s: float) -> None:
    """Requests whose KV is ready at ``ready_s``, each on the decode ``placed`` (-1: none)."""
    n = len(inputs)
    sim.wait.put(
        {"sid": np.arange(n), "arr": np.zeros(n), "ready": np.full(n, ready_s),
         "inp": np.array(inputs), "inp0": np.array(inputs), "cached": np.zeros(n),
         "out": np.full(n, 100.0), "gen": np.zeros(n), "first": np.full(n, np.nan),
         "inst": np.array(placed, dtype=np.int64), "tried": np.zeros(n, dtype=bool)}
    )  # fmt: skip


def _decode_sim(routing: Routing) -> Simulator:
    """Two ready decode instances, the first holding all but 10% of its KV."""
    traffic = SessionTraffic(_sessions(1), [Placement(1000.0, 0)])  # nothing arrives
    sim = Simulator(_cfg(1, 2, 60.0, prepopulate=False, routing=routing), sessions=traffic)
    _waiting(sim, [0.9 * D.kv_capacity_tokens - 100.0], [0], 0.0)
    sim._admit_decode(0.0, 0.5)
    assert len(sim.act) == 1 and sim.act["inst"][0] == 0
    return sim


@pytest.mark.parametrize("routing", [ConsistentHashRouting(), ManualRouting()])
def test_keyed_routers_send_decodes_in_turn_and_a_request_waits_on_its_own(
    routing: Routing,
) -> None:
    """Behind the keyed policies the operator runs `--decode-policy round_robin`
    (desired.resources.router.policy_args) and an SGLang decode admits its own prealloc queue
    FIFO: a request given a full decode waits there, and those behind it too, though another
    decode has room. Regression: the simulator handed every waiting request to whichever
    decode had the most free KV, a pool no router makes, and on real sessions it served 8.99
    req/s at 26P:6D where round robin serves 7.86 (the best split moved to 24P:8D)."""
    sim = _decode_sim(routing)
    quarter = 0.25 * D.kv_capacity_tokens
    _waiting(sim, [quarter], [0], 1.0)  # given the full decode: it waits there
    _waiting(sim, [1000.0] * 4, [-1] * 4, 1.5)  # new ones: one decode each, in turn
    sim._admit_decode(1.0, 2.0)
    # two of the new ones were given the full decode and wait behind the first: FIFO
    assert sim.wait["inst"].tolist() == [0, 0, 0], sim.wait["inst"]
    assert sorted(sim.wait["inp"].tolist()) == [1000.0, 1000.0, quarter]
    assert sim.act["inst"].tolist() == [0, 1, 1]


def test_cache_aware_decodes_take_any_decode_with_room() -> None:
    """The synthetic benchmarks' placement (`engine.decodes_in_turn`): a
    waiting request goes to the decode with the most free KV."""
    sim = _decode_sim(CacheAwareRouting())
    _waiting(sim, [0.25 * D.kv_capacity_tokens], [0], 1.0)
    sim._admit_decode(1.0, 2.0)
    assert len(sim.wait) == 0 and sim.act["inst"].tolist() == [0, 1]
