"""Coding-agent load generator: ``python -m cas_engine.sim.load`` (against any SGLang-style URL).

Workload model (after the GLM-5 production report: long inputs, mostly shared prefixes):
``--sessions`` concurrent agent sessions; each starts from a system prompt shared by every
session (tool definitions) plus its own repository context, then runs turns: a streaming chat
request, a tool-call pause, and a tool result appended to the conversation, so each prompt
extends the previous one (high prefix-cache hit rate) and the context grows until
``--max-context`` tokens, when the session starts over. Output lengths are log-normal around
``--output-tokens``. Sizes are in sim tokens (4 bytes of text each).

Bounded: stops after ``--requests`` requests or ``--duration`` seconds, whichever comes first;
every request has a timeout. Reports throughput, TTFT / ITL percentiles, errors, guard trips and
garbled outputs, and (with ``--launch`` or ``--pids``) the CPU the sim processes used. With
``--launch`` it starts its own fleet (router + prefill + decode sims, see :mod:`.fleet`) and
stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from cas_engine.sim.textgen import GARBLE, VOCAB

BYTES_PER_TOKEN = 4


@dataclass
class Totals:
    """Everything measured; owned by the run, filled by the sessions."""

    ok: int = 0
    errors: int = 0
    guard_trips: int = 0
    garbled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # per-request mean inter-token latency
    error_kinds: dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return self.ok + self.errors

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` sim tokens of code-like text."""
    words: list[str] = []
    size = 0
    while size < tokens * BYTES_PER_TOKEN:
        w = rng.choice(VOCAB)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


@dataclass
class Workload:
    sessions: int = 8
    system_tokens: int = 4000
    repo_tokens: int = 8000
    tool_tokens: int = 1500
    max_context: int = 32000
    output_tokens: int = 250
    max_output: int = 1500
    tool_pause_s: float = 2.0
    speedup: float = 20.0
    seed: int = 0
    model: str = "sim"


class Session:
    """One agent conversation; owns its message list."""

    def __init__(self, wl: Workload, sid: int, system: str) -> None:
        self.wl = wl
        self.rng = random.Random(wl.seed * 1000 + sid)
        self.sid = sid
        self.system = system
        self.reset()

    def reset(self) -> None:
        repo = _text(self.rng, self.wl.repo_tokens)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": f"session {self.sid}: fix the failing test.\n{repo}"},
        ]
        self.tokens = self.wl.system_tokens + self.wl.repo_tokens

    def request(self) -> dict[str, Any]:
        mu = math.log(self.wl.output_tokens)
        out = int(min(self.wl.max_output, max(16, self.rng.lognormvariate(mu, 0.6))))
        return {
            "model": self.wl.model,
            "messages": self.messages,
            "max_tokens": out,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def advance(self, answer: str) -> None:
        """Append the answer and a tool result; start over beyond the context limit."""
        tool = _text(self.rng, int(self.rng.uniform(0.3, 1.7) * self.wl.tool_tokens))
        call = f"call_{self.sid}_{len(self.messages)}"
        tool_name = self.rng.choice(("read_file", "run_tests", "grep", "apply_patch"))
        self.messages.append(
            {
                "role": "assistant",
                "content": answer,
                "tool_calls": [
                    {
                        "id": call,
                        "type": "function",
                        "function": {"name": tool_name, "arguments": "{}"},
                    }
                ],
            }
        )
        self.messages.append({"role": "tool", "tool_call_id": call, "content": tool})
        self.tokens += len(answer) // BYTES_PER_TOKEN + len(tool) // BYTES_PER_TOKEN
        if self.tokens > self.wl.max_context:
            self.reset()


async def _one(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], totals: Totals
) -> str | None:
    """Send one streaming chat request; record its numbers; return the answer text or None."""
    t0 = time.monotonic()
    first: float | None = None
    last = t0
    parts: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                payload = await resp.text()
                totals.error(
                    "guard_trip" if "cas_guard_tripped" in payload else f"http_{resp.status}"
                )
                if "cas_guard_tripped" in payload:
                    totals.guard_trips += 1
                return None
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tripped = event["error"].get("type") == "cas_guard_tripped"
                    totals.guard_trips += tripped
                    totals.error("guard_trip" if tripped else "stream_error")
                    return None
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.monotonic()
                        if first is None:
                            first = now
                            totals.ttft.append(now - t0)
                        last = now
                        parts.append(piece)
    except (aiohttp.ClientError, TimeoutError) as exc:
        totals.error(type(exc).__name__)
        return None
    answer = "".join(parts)
    totals.ok += 1
    n_out = int(usage.get("completion_tokens", 0))
    if first is not None and n_out > 1:  # per-request mean: robust to coalesced SSE chunks
        totals.itl.append((last - first) / (n_out - 1))
    totals.garbled += any(g in answer for g in GARBLE)
    totals.prompt_tokens += int(usage.get("prompt_tokens", 0))
    totals.completion_tokens += int(usage.get("completion_tokens", 0))
    totals.cached_tokens += int(
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    )
    return answer


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0 = total, enabled, time.monotonic()

    def show(self, totals: Totals) -> None:
        if not self.enabled:
            return
        width = 30
        frac = min(1.0, totals.done / max(1, self.total))
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = totals.done / max(1e-9, time.monotonic() - self.t0)
        sys.stderr.write(
            f"\r[{bar}] {totals.done}/{self.total} req  {rate:5.1f} req/s  "
            f"err {totals.errors}  trips {totals.guard_trips}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_load(
    url: str,
    wl: Workload,
    *,
    max_requests: int,
    duration_s: float,
    timeout_s: float = 120.0,
    progress: bool = True,
) -> tuple[Totals, float]:
    """Drive the workload; returns the totals and the wall seconds it took."""
    totals = Totals()
    system = _text(random.Random(wl.seed), wl.system_tokens)
    sessions = [Session(wl, i, system) for i in range(wl.sessions)]
    budget = {"left": max_requests}
    deadline = time.monotonic() + duration_s
    bar = _Progress(max_requests, progress)

    async def agent(sess: Session, http: aiohttp.ClientSession) -> None:
        await asyncio.sleep(sess.rng.uniform(0, wl.tool_pause_s / wl.speedup))
        while budget["left"] > 0 and time.monotonic() < deadline:
            budget["left"] -= 1
            answer = await _one(http, url, sess.request(), totals)
            bar.show(totals)
            if answer is None:
                sess.reset()
            else:
                sess.advance(answer)
            pause = sess.rng.expovariate(1.0 / wl.tool_pause_s) / wl.speedup
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))

    t0 = time.monotonic()
    tmo = aiohttp.ClientTimeout(total=timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=tmo, connector=conn) as http:
        await asyncio.gather(*[agent(s, http) for s in sessions])
    bar.close()
    return totals, time.monotonic() - t0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (Linux /proc), 0 when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(totals: Totals, wall: float, cpu: dict[str, float]) -> dict[str, Any]:
    """The result dict (what the table prints and ``--json`` writes)."""
    ms = 1000.0
    return {
        "wall_s": wall,
        "requests_ok": totals.ok,
        "errors": totals.errors,
        "error_kinds": totals.error_kinds,
        "guard_trips": totals.guard_trips,
        "garbled_outputs": totals.garbled,
        "req_per_s": totals.done / wall if wall else 0.0,
        "output_tok_per_s": totals.completion_tokens / wall if wall else 0.0,
        "input_tok_per_s": totals.prompt_tokens / wall if wall else 0.0,
        "prefix_cache_hit_rate": (
            totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0
        ),
        "ttft_ms": {
            q: _pct(totals.ttft, p) * ms for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "itl_ms": {
            q: _pct(totals.itl, p) * ms for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "sim_cpu_cores": cpu,
    }


def print_table(res: dict[str, Any], speedup: float) -> None:
    rows = [
        ("requests ok / errors", f"{res['requests_ok']} / {res['errors']} {res['error_kinds']}"),
        ("guard trips / garbled outputs", f"{res['guard_trips']} / {res['garbled_outputs']}"),
        (
            "throughput (wall)",
            f"{res['req_per_s']:.2f} req/s, "
            f"{res['output_tok_per_s']:.0f} out tok/s, "
            f"{res['input_tok_per_s']:.0f} in tok/s",
        ),
        ("prefix cache hit rate", f"{res['prefix_cache_hit_rate']:.1%}"),
        ("TTFT p50/p90/p99 (wall ms)", "/".join(f"{v:.1f}" for v in res["ttft_ms"].values())),
        ("ITL/request p50/p90/p99 (wall ms)", "/".join(f"{v:.2f}" for v in res["itl_ms"].values())),
        ("sim time scale", f"{speedup}x (modelled = wall x {speedup})"),
    ]
    for name, cores in res["sim_cpu_cores"].items():
        rows.append((f"CPU {name}", f"{cores:.2f} cores"))
    width = max(len(r[0]) for r in rows)
    print(f"{'metric':<{width}}  value")
    print("-" * (width + 2 + 40))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cas_engine.sim.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", help="router or worker URL (default: --launch a local fleet)")
    p.add_argument("--launch", action="store_true", help="start router + sims, stop at the end")
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--speedup", type=float, default=20.0, help="sim --sim-speedup")
    p.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        help="extra argument for every sim worker (repeatable, e.g. "
        "--sim-arg=--sim-fault --sim-arg=repetition=0.01)",
    )
    p.add_argument("--requests", type=int, default=300, help="stop after this many requests")
    p.add_argument("--duration", type=float, default=60.0, help="stop after this many seconds")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=4000)
    p.add_argument("--repo-tokens", type=int, default=8000)
    p.add_argument("--tool-tokens", type=int, default=1500)
    p.add_argument("--max-context", type=int, default=32000)
    p.add_argument("--output-tokens", type=int, default=250)
    p.add_argument("--tool-pause", type=float, default=2.0, help="mean tool pause (sim s)")
    p.add_argument("--pids", default="", help="comma-separated sim pids to report CPU for")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    wl = Workload(
        sessions=args.sessions,
        system_tokens=args.system_tokens,
        repo_tokens=args.repo_tokens,
        tool_tokens=args.tool_tokens,
        max_context=args.max_context,
        output_tokens=args.output_tokens,
        tool_pause_s=args.tool_pause,
        speedup=args.speedup,
    )
    fleet = None
    pids: dict[str, int] = {f"pid {p}": int(p) for p in args.pids.split(",") if p.strip()}
    url = args.url
    if url is None or args.launch:
        from cas_engine.sim.fleet import Fleet

        fleet = Fleet(
            prefills=args.prefills,
            decodes=args.decodes,
            speedup=args.speedup,
            common_args=list(args.sim_arg),
        ).start()
        url = fleet.router_url
        names = (
            [f"prefill{i}" for i in range(args.prefills)]
            + [f"decode{i}" for i in range(args.decodes)]
            + ["router"]
        )
        pids = dict(zip(names, fleet.pids, strict=True))
        print(
            f"fleet: router {url}, prefill {fleet.prefill_urls}, decode {fleet.decode_urls}",
            file=sys.stderr,
        )
    try:
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
        totals, wall = asyncio.run(
            run_load(
                url,
                wl,
                max_requests=args.requests,
                duration_s=args.duration,
                progress=not args.no_progress,
            )
        )
        cpu = {n: (cpu_seconds(p) - cpu0[n]) / wall for n, p in pids.items()}
    finally:
        if fleet is not None:
            fleet.stop()
    res = summarize(totals, wall, cpu)
    res["workload"] = asdict(wl)
    print_table(res, args.speedup)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0 if totals.ok else 1


if __name__ == "__main__":
    sys.exit(main())
