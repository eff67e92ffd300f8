"""Bench: the PD reclaim race on the sim fleet, Immediate vs Upstream vs Strict side by side.

One prefill whose KV writes sometimes stall (``--stall-rate``, ``--stall-s`` sim seconds, longer
than Upstream's 30 s release timer) and three decode workers behind the real SGLang router, one
per reclaim mode, fed the same traffic in one run (round robin). The decode aborts a request
whose KV misses the prefill budget (``--budget`` sim s); with ``Immediate`` the slot is reused at
once, with ``Upstream`` after the timer, with ``Strict`` only after the prefill's ack. Reports,
per mode, the requests whose KV slot was overwritten (bad outputs per 10,000 requests) and the
guard trips. Prints one table, writes ``--json``.

    .venv/bin/python bench/sim_race.py --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp

from cas_engine.sim.fleet import Fleet

MODES = ("Immediate", "Upstream", "Strict")


async def traffic(url: str, n: int, concurrency: int, max_tokens: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def one(i: int) -> int:
            body = {
                "model": "sim",
                "max_tokens": max_tokens,
                "stream": True,
                "messages": [{"role": "user", "content": f"agent turn {i} " * 8}],
            }
            async with sem, http.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*[one(i) for i in range(n)])
    return sum(1 for s in statuses if s == 200)


async def stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/sim/stats") as resp:
        body: dict[str, Any] = (await resp.json())["stats"]
        return body


async def drain(urls: list[str], timeout: float) -> None:
    """Wait until no decode has quarantined slots (stalled writes landed and acked)."""
    for _ in range(int(timeout / 0.2)):
        quarantined = [(await stats(u)).get("kv_quarantined_slots", 0) for u in urls]
        if not any(quarantined):
            return
        await asyncio.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--stall-rate", type=float, default=0.1)
    p.add_argument("--stall-s", type=float, default=40.0)
    p.add_argument("--budget", type=float, default=5.0)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--json", type=Path, default=Path("bench/results/sim_race.json"))
    args = p.parse_args()
    decode_args = [["--sim-kv-reclaim", m, "--sim-prefill-budget", str(args.budget)] for m in MODES]
    fleet = Fleet(
        prefills=1,
        decodes=len(MODES),
        speedup=args.speedup,
        prefill_args=[["--sim-fault", f"kv_write_stall={args.stall_rate}:{args.stall_s}"]],
        decode_args=decode_args,
    )
    with fleet:
        ok = asyncio.run(
            traffic(fleet.router_url, args.requests, args.concurrency, args.max_tokens)
        )
        asyncio.run(drain(fleet.decode_urls, args.stall_s / args.speedup + 5))
        per_mode = {m: asyncio.run(stats(u)) for m, u in zip(MODES, fleet.decode_urls, strict=True)}
    print(f"client requests: {args.requests}, answered 200: {ok} (router retries included)")
    print(
        f"{'reclaim':<10} {'requests':>9} {'aborted':>8} {'corrupted':>10} {'per 10k':>8} "
        f"{'guard trips':>12}"
    )
    rows = {}
    for mode, st in per_mode.items():
        per10k = 1e4 * st["kv_corrupted"] / max(1, st["requests"])
        rows[mode] = {**st, "corrupted_per_10k": per10k}
        print(
            f"{mode:<10} {st['requests']:>9} {st['kv_timeouts']:>8} {st['kv_corrupted']:>10} "
            f"{per10k:>8.1f} {st['guard_trips']:>12}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"args": vars(args) | {"json": str(args.json)}, "client_ok": ok, "modes": rows},
            indent=2,
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
