"""Real Claude Code sessions through a fleet with two prefills on the local stack: the hit rate
the engines achieve against an exact LRU over the pool's whole cache (issue 40).

A time-compressed slice of ../shared/traces (24 sessions starting 1 a second, think times x 0.02,
token counts / 16, at most 16 requests a session, 35 s; each prefill sim holding 60K tokens, so
the sessions' prompts do not all fit) goes through the fleet's entry Service (kube-proxy over
the 2 router replicas, a new connection per request) by `bench.replay`, closed loop, each
request naming its session in the headers real clients send. The bound is the same prompts, in
the order sent, through one exact LRU of both prefills' capacity.

Regression guarded: smg's default policy was cache_aware, which kept no session on the prefill
holding its prefix as well (this slice: 0 errors but 88% of the bound); smg's default is now
consistent_hashing on the session id, the same prefill from either router replica (98.7-100% in
three runs).
sglang-router's keyed policy, manual, keeps a map per router replica: with 2 replicas a session
alternates between prefills (76-79% of the bound on this slice at 45 s; 70% with 20K-token
prefills), so it is measured by ``make bench-replay``, not held to the goal here
(docs/traffic.md).
"""

from __future__ import annotations

import asyncio

import pytest

from bench.replay.client import Replay, ReplayConfig
from bench.replay.local import (
    MODEL,
    Policy,
    engine_hit_rate,
    engine_tokens,
    fleet_up,
    replay_fleet,
    sim_args,
    wait_serving,
)
from bench.replay.prompts import Scale
from bench.replay.sources import claude_source
from bench.traces import SessionPool
from cas_engine.sim.fleet import router_available
from e2e.fleet.fleetview import Kubectl
from e2e.fleet.livestack import MakeLiveStack
from tests.real_traces import CLAUDE_SESSIONS, require

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
]

PREFILLS, DECODES = 2, 1
CAPACITY = 60_000  # tokens of prefix cache per prefill sim: the sessions' prompts do not all fit
SPEEDUP = 20.0
SESSIONS, RATE = 24, 1.0  # session starts per second
SLICE = {"max_turns": 16, "duration_s": 35.0}
GOAL = 0.9  # achieved >= 90% of the bound (docs/traffic.md)


def test_real_sessions_hit_what_the_pool_could_hold_through_smgs_default_policy(
    live_stack: MakeLiveStack, namespace: str, kubectl: Kubectl, crds: None
) -> None:
    pool = SessionPool.load(require(CLAUDE_SESSIONS), limit=SESSIONS)
    stack = live_stack(sim_args(CAPACITY, SPEEDUP))
    fleet = replay_fleet(Policy("smg"), PREFILLS, DECODES)  # its default policy
    with fleet_up(stack, kubectl, fleet, log=lambda s: print(f"[live] {s}")):
        url = wait_serving(kubectl, namespace, PREFILLS, DECODES)
        before = engine_tokens(kubectl, namespace)
        config = ReplayConfig(
            url=url, model=MODEL, pool_capacity_tokens=PREFILLS * CAPACITY,
            scale=Scale(tokens=16, think=0.02), **SLICE,  # type: ignore[arg-type]
        )  # fmt: skip
        replay = Replay(config, claude_source(pool, RATE, SESSIONS, seed=1))
        asyncio.run(replay.run())
        engines = engine_hit_rate(before, engine_tokens(kubectl, namespace))
    s = replay.snapshot()
    shown = ("requests", "errors", "achieved_hit_rate", "bound_hit_rate", "ratio", "ttft_p50_s",
             "ttft_p90_s", "requests_per_prefill")  # fmt: skip
    print({k: s[k] for k in shown})
    assert s["requests"] >= 120 and s["errors"] == 0, s["error_kinds"]
    assert s["token_mismatches"] == 0  # the engines counted the prompts the bound counted
    assert engines == pytest.approx(s["achieved_hit_rate"], abs=1e-9)  # their own metrics agree
    assert s["bound_hit_rate"] < 0.97  # the cache is full: routing matters
    assert s["ratio"] >= GOAL, s
