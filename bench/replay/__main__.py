"""``python -m bench.replay``: replay real coding-agent sessions through a fleet.

Two ways to point it at a fleet:

- ``--url URL --pool-capacity TOKENS --model NAME``: a fleet you run (its entry Service or
  gateway); the pool capacity (every prefill's prefix cache together, in tokens as the
  engines count them) is the bound's;
- ``--local``: on the local stack (``make cluster-up``'s, else one started for the run), one
  fleet per ``--policies`` entry (``sglang-router/manual``, ``smg/consistent_hashing``,
  ``smg`` for its default...), ``--prefills`` prefill sims of ``--capacity`` tokens each,
  made, replayed through its entry Service and deleted in turn.

Sessions: ``--trace`` (a folder or tarball of Claude Code session files: the kv-cache-tester
format), started as a Poisson process at ``--rate`` per second, ``--sessions`` of them, each
request sent when the previous one of its session has been answered and its think time times
``--think-scale`` has passed; or Mooncake's JSONL (``.jsonl``: its first ``--sessions``
requests at its own arrival times rescaled to ``--rate`` requests per second); token counts
divided by ``--token-scale`` (``bench.replay.prompts``); nothing sent after ``--duration``.
Prints progress, then a table; writes ``--out`` (JSON: the settings and one row per fleet:
requests, errors, achieved hit rate, the bound, TTFT p50/p90, goodput).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.replay.client import Replay, ReplayConfig, run_with_progress
from bench.replay.prompts import Scale
from bench.replay.sources import Source, open_source

DEFAULT_OUT = Path("bench/results/replay.json")
DEFAULT_POLICIES = (
    "sglang-router/cache_aware,sglang-router/round_robin,sglang-router/power_of_two,"
    "sglang-router/manual,smg/cache_aware,smg/manual,smg/consistent_hashing"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--trace", required=True, help="Claude Code sessions: a folder or tarball")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the fleet's entry point, e.g. http://10.96.0.20")
    where.add_argument("--local", action="store_true", help="fleets on the local stack")
    p.add_argument("--model", default="", help="--url: the served model name")
    p.add_argument("--pool-capacity", type=int, default=0,
                   help="--url: every prefill's prefix cache together (tokens)")  # fmt: skip
    p.add_argument("--api-key", default="", help="--url: sent as a Bearer token")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="--local: implementation[/policy],... (default: all compared)")  # fmt: skip
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--capacity", default="",
                   help="--local: prefix cache per prefill sim in tokens, or several (a,b: "
                        "every policy at each; default: the sim's 2M / --token-scale)")  # fmt: skip
    p.add_argument("--speedup", type=float, default=20.0, help="--local: the sims' speedup")
    p.add_argument("--rate", type=float, default=0.3, help="session starts per second")
    p.add_argument("--sessions", type=int, default=60, help="session starts in all")
    p.add_argument("--duration", type=float, default=300.0, help="send nothing after (s)")
    p.add_argument("--max-turns", type=int, default=None, help="requests per session at most")
    p.add_argument("--token-scale", type=int, default=16, help="token counts divided by this")
    p.add_argument("--think-scale", type=float, default=0.05, help="think times times this")
    p.add_argument("--connections", choices=("per-request", "shared"), default="per-request",
                   help="a new connection per request (spread over the router replicas as "
                        "an L7 gateway does), or one keep-alive pool")  # fmt: skip
    p.add_argument("--ttft-slo", type=float, default=0.0,
                   help="goodput's TTFT bound in wall seconds (--local default: 4 s of "
                        "modelled time, divided by the speedup)")  # fmt: skip
    p.add_argument("--limit", type=int, default=200, help="sessions read from the trace")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def _config(args: argparse.Namespace, url: str, model: str, pool: int) -> ReplayConfig:
    slo = args.ttft_slo or (4.0 / args.speedup if args.local else 4.0)
    return ReplayConfig(
        url=url.rstrip("/"), model=model, pool_capacity_tokens=pool,
        scale=Scale(tokens=args.token_scale, think=args.think_scale),
        duration_s=args.duration, max_turns=args.max_turns,
        connection_per_request=args.connections == "per-request",
        ttft_slo_s=slo, api_key=args.api_key,
    )  # fmt: skip


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a row was measured under (the stated factors among them)."""
    return {
        "trace": str(args.trace), "sessions": args.sessions, "rate_per_s": args.rate,
        "limit": args.limit,
        "duration_s": args.duration, "max_turns": args.max_turns,
        "token_scale": args.token_scale, "think_scale": args.think_scale,
        "prefills": args.prefills, "decodes": args.decodes,
        "sim_speedup": args.speedup,
        "connections": args.connections, "seed": args.seed,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def replay_once(config: ReplayConfig, source: Source) -> dict[str, Any]:
    """One replay with progress lines; its summary."""
    replay = Replay(config, source)
    return asyncio.run(run_with_progress(replay, out=lambda s: print(s, flush=True)))


def run_url(args: argparse.Namespace, source: Source) -> dict[str, Any]:
    if not args.model or args.pool_capacity <= 0:
        raise SystemExit("--url needs --model and --pool-capacity")
    row = replay_once(_config(args, args.url, args.model, args.pool_capacity), source)
    row["pool_capacity_tokens"] = args.pool_capacity
    return {"settings": settings(args), "runs": [{"fleet": args.url, **row}]}


def run_local(args: argparse.Namespace, source: Source) -> dict[str, Any]:
    from bench.replay.local import (
        MODEL,
        SIM_KV_CAPACITY,
        Policy,
        engine_hit_rate,
        engine_tokens,
        fleet_up,
        replay_fleet,
        sim_args,
        wait_serving,
    )
    from e2e.cluster.stack import run_kubectl
    from e2e.demo.run_local import open_cluster
    from e2e.fleet.fleetview import apply_crds
    from e2e.fleet.livestack import LiveStack
    from e2e.paths import REPO_ROOT

    capacities = [int(c) for c in args.capacity.split(",") if c] or [
        SIM_KV_CAPACITY // args.token_scale
    ]
    result: dict[str, Any] = {"settings": settings(args), "runs": []}
    cluster, started = open_cluster()

    def kubectl(*a: str, stdin: str | None = None, check: bool = True) -> str:
        return run_kubectl(cluster.kubectl_path, cluster.kubeconfig, *a, stdin=stdin, check=check)

    try:
        apply_crds(kubectl)
        for capacity, text in itertools.product(capacities, args.policies.split(",")):
            policy = Policy.parse(text.strip())
            ns = f"replay-{policy.label.replace('/', '-').replace('_', '-')}-{uuid.uuid4().hex[:5]}"
            kubectl("create", "namespace", ns)
            run_dir = REPO_ROOT / "run" / "replay" / ns
            stack = LiveStack(cluster.kubeconfig, ns, run_dir,
                              sim_args=sim_args(capacity, args.speedup),
                              operator_args=("-n", ns))  # fmt: skip
            try:
                print(f"== {policy.label} in namespace {ns}", flush=True)
                fleet = replay_fleet(policy, args.prefills, args.decodes)
                with fleet_up(stack, kubectl, fleet, log=lambda s: print(f"[live] {s}")):
                    url = wait_serving(kubectl, ns, args.prefills, args.decodes)
                    before = engine_tokens(kubectl, ns)
                    config = _config(args, url, MODEL, capacity * args.prefills)
                    row = replay_once(config, source)
                    row["engine_hit_rate"] = engine_hit_rate(before, engine_tokens(kubectl, ns))
                result["runs"].append({"implementation": policy.implementation,
                                       "policy": policy.policy or "default",
                                       "capacity_per_prefill_tokens": capacity, **row})  # fmt: skip
                write(args.out, result)  # what is measured so far survives a later failure
            finally:
                kubectl("delete", "namespace", ns, "--wait=false", check=False)
    finally:
        if started:
            for line in cluster.stop():
                print(line)
    return result


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")


def table(result: dict[str, Any]) -> str:
    """One line per fleet: the routing table."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    head = (f"{'fleet':<30} {'cache/prefill':>13} {'requests':>8} {'errors':>6} "
            f"{'hit':>7} {'bound':>7} {'ratio':>6} {'TTFT p50':>9} {'p90 (ms)':>9} "
            f"{'goodput/s':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        name = r.get("fleet") or f"{r['implementation']}/{r['policy']}"
        cache = r.get("capacity_per_prefill_tokens", "-")
        lines.append(
            f"{name:<30} {cache:>13} {r['requests']:>8} {r['errors']:>6} "
            f"{pct(r['achieved_hit_rate']):>7} {pct(r['bound_hit_rate']):>7} "
            f"{pct(r['ratio']):>6} {ms(r['ttft_p50_s']):>9} "
            f"{ms(r['ttft_p90_s']):>9} {r['goodput_rps']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        source = open_source(args.trace, args.rate, args.sessions, args.seed, args.limit)
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
    print(f"{len(source.places)} {source.format} session starts from {args.trace}", flush=True)
    result = run_local(args, source) if args.local else run_url(args, source)
    write(args.out, result)
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
