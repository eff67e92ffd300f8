"""Bench: can one sim decode worker sustain N concurrent streams at its modelled token rate?

``cpu us/tok`` is the worker's CPU time per streamed token (HTTP and SSE included): one core
sustains 1e6 / that many tokens/s, to compare with the modelled rate.
``realtime`` is the worker's own ``decode_realtime_factor`` (modelled / actual step time;
1.0 = the sim kept the modelled pace, so the sim was not the bottleneck). The achieved rate is
below the full-batch model because of ramp-up and the tail of the run (requests finish at
different steps, so the last steps run smaller batches).

Starts one ``null``-mode sim worker (prefill + decode in one process, speedup 1 = real-time
model) as a subprocess, opens ``--streams`` concurrent streaming chat requests (short prompts,
``--tokens`` output tokens each) from this process, and compares the achieved output token rate
with the rate the timing model predicts for that batch size (step time at batch N, times the
mean tokens per step). Also reports the worker's CPU use (cores) from /proc. Prints one table and
writes ``--json``. Run a few times and read medians: the machines are noisy.

    .venv/bin/python bench/sim_throughput.py --streams 256 --tokens 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from cas_engine.sim.fleet import _wait_http, free_port
from cas_engine.sim.load import cpu_seconds
from cas_engine.sim.timing import TimingParams, decode_step_seconds


def modelled_tokens_per_s(streams: int, tokens: int, accept_prob: float, steps: int) -> float:
    """Output tokens/s the model predicts for a full batch of ``streams`` requests."""
    mean_acc = sum(accept_prob**k for k in range(1, steps + 1))
    kv = streams * tokens // 2  # average KV held by a request over its life (short prompts)
    step = decode_step_seconds(TimingParams(), streams, kv)
    return streams * (mean_acc + 1.0) / step


async def drive(url: str, streams: int, tokens: int) -> tuple[int, float, int]:
    """Open the streams at once; return (completion tokens, wall seconds, failures)."""
    body = {
        "model": "sim",
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def one(http: aiohttp.ClientSession, i: int) -> int:
        req = {**body, "messages": [{"role": "user", "content": f"stream {i}"}]}
        async with http.post(f"{url}/v1/chat/completions", json=req) as resp:
            tail = b""
            async for chunk in resp.content.iter_any():
                tail = (tail + chunk)[-4096:]
        usage = [ln for ln in tail.split(b"\n") if b'"usage"' in ln]
        return int(json.loads(usage[-1][6:])["usage"]["completion_tokens"]) if usage else 0

    conn = aiohttp.TCPConnector(limit=0)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        counts = await asyncio.gather(*[one(http, i) for i in range(streams)])
    return sum(counts), time.monotonic() - t0, sum(1 for c in counts if c != tokens)


def run_once(streams: int, tokens: int, log: Path) -> dict[str, float]:
    import subprocess

    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cas_engine.sim",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--max-running-requests",
                str(max(256, streams)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", 30, [proc])
        cpu0 = cpu_seconds(proc.pid)
        done, wall, failed = asyncio.run(drive(url, streams, tokens))
        cpu = (cpu_seconds(proc.pid) - cpu0) / wall
        with urllib.request.urlopen(f"{url}/sim/stats", timeout=10) as resp:
            realtime = float(json.loads(resp.read())["stats"]["decode_realtime_factor"])
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "tokens": done,
        "wall_s": wall,
        "tok_per_s": done / wall,
        "worker_cores": cpu,
        "failed": failed,
        "realtime_factor": realtime,
        "cpu_us_per_token": 1e6 * cpu * wall / max(1, done),
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path, default=Path("bench/results/sim_throughput.json"))
    args = p.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    runs = [
        run_once(args.streams, args.tokens, args.json.with_suffix(".worker.log"))
        for _ in range(args.runs)
    ]
    model = modelled_tokens_per_s(args.streams, args.tokens, 0.75, 3)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"{'streams':>8} {'tokens':>7} {'model tok/s':>12} {'achieved tok/s':>15} "
        f"{'ratio':>6} {'worker cores':>13} {'cpu us/tok':>11} {'realtime':>9} {'failed':>7}"
    )
    print(
        f"{args.streams:>8} {args.tokens:>7} {model:>12.0f} {med['tok_per_s']:>15.0f} "
        f"{med['tok_per_s'] / model:>6.2f} {med['worker_cores']:>13.2f} "
        f"{med['cpu_us_per_token']:>11.1f} "
        f"{med['realtime_factor']:>9.3f} {med['failed']:>7.0f}"
    )
    args.json.write_text(
        json.dumps(
            {
                "streams": args.streams,
                "tokens": args.tokens,
                "modelled_tok_per_s": model,
                "median": med,
                "runs": runs,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
