"""One prefill and two decode sim workers behind the REAL SGLang router (PD mode, loopback).

Guards: the sim's request/response shapes drifting from what the router sends and relays
(bootstrap fields, OpenAI chunks), replays that stop being deterministic, guard trips that the
router cannot retry, the strict reclaim fence not preventing the stale-write corruption that
``Immediate`` reclaim shows, and metrics that disagree with the traffic.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cas_engine.sim.fleet import Fleet, router_available
from cas_engine.sim.textgen import GARBLE

pytestmark = [
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed"),
    pytest.mark.timeout(90),
]

TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(prefills=1, decodes=2, speedup=20.0, log_dir=Path(tmp_path_factory.mktemp("fleet")))
    f.start()
    try:
        yield f
    finally:
        f.stop()


def _chat(content: str, max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim",
        "messages": [
            {"role": "system", "content": "You are a coder."},
            {"role": "user", "content": content},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.text()


def _sse_events(text: str) -> list[Any]:
    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _metric(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (any labels) in a Prometheus exposition."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


async def _scrape(session: aiohttp.ClientSession, urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        async with session.get(f"{url}/metrics") as resp:
            total += _metric(await resp.text(), name)
    return total


async def _set_fault(session: aiohttp.ClientSession, url: str, spec: dict[str, Any]) -> None:
    async with session.post(f"{url}/sim/fault", json=spec) as resp:
        assert resp.status == 200, await resp.text()


async def test_chat_non_streaming_shape_through_router(fleet: Fleet) -> None:
    """Regression: OpenAI chat shape (choices/message/usage) and the simulator marker."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, text = await _post(
            s, f"{fleet.router_url}/v1/chat/completions", _chat("write a function", 40)
        )
    assert status == 200, text
    body = json.loads(text)
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 40
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 40
    assert body["metadata"]["simulated"] is True


async def test_chat_streaming_completes_through_router(fleet: Fleet) -> None:
    """Regression: SSE chunks relayed by the router end with a finish chunk, usage and [DONE]."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, text = await _post(
            s,
            f"{fleet.router_url}/v1/chat/completions",
            _chat("stream it", 30, stream=True, stream_options={"include_usage": True}),
        )
    assert status == 200, text
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = [e for e in events[:-1] if e.get("usage")]
    assert usage and usage[-1]["usage"]["completion_tokens"] == 30
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content.strip()


async def test_replay_is_deterministic_across_decode_workers(fleet: Fleet) -> None:
    """Regression: the same request replayed (round robin: other decode) gives the same text."""
    body = _chat("replay me exactly", 60)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        texts = []
        for _ in range(3):
            status, text = await _post(s, f"{fleet.router_url}/v1/chat/completions", body)
            assert status == 200, text
            texts.append(json.loads(text)["choices"][0]["message"]["content"])
        status, other = await _post(
            s, f"{fleet.router_url}/v1/chat/completions", _chat("a different prompt", 60)
        )
    assert texts[0] == texts[1] == texts[2]
    assert json.loads(other)["choices"][0]["message"]["content"] != texts[0]


async def test_generate_endpoint_through_router(fleet: Fleet) -> None:
    """Regression: SGLang /generate shape (text + meta_info with spec stats)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, text = await _post(
            s,
            f"{fleet.router_url}/generate",
            {"text": "def f(x):", "sampling_params": {"max_new_tokens": 50}},
        )
    assert status == 200, text
    meta = json.loads(text)["meta_info"]
    assert meta["completion_tokens"] == 50 and meta["finish_reason"]["type"] == "length"
    assert meta["spec_verify_ct"] > 0 and 1.0 <= meta["spec_accept_length"] <= 4.0
    assert meta["simulated"] is True


async def test_guard_trip_is_retried_by_router_on_healthy_decode(fleet: Fleet) -> None:
    """Regression: a non-streaming request aborted by the guard (503) must reach the client
    as a good answer from the other decode worker, via the router's retry."""
    bad = fleet.decode_urls[1]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        trips0 = await _scrape(s, [bad], "cas_guard_trips_total")
        await _set_fault(s, bad, {"repetition": 1.0})
        try:
            results = await asyncio.gather(
                *[
                    _post(s, f"{fleet.router_url}/v1/chat/completions", _chat(f"job {i}", 200))
                    for i in range(6)
                ]
            )
        finally:
            await _set_fault(s, bad, {"repetition": 0.0})
        trips = await _scrape(s, [bad], "cas_guard_trips_total") - trips0
    assert trips >= 1, "the faulty decode never received a request"
    for status, text in results:
        assert status == 200, text
        content = json.loads(text)["choices"][0]["message"]["content"]
        assert "the same line again" not in content


async def test_router_max_retries_counts_attempts_and_may_retry_on_the_failed_worker(
    tmp_path: Path,
) -> None:
    """The router semantics the operator's `router.retries` rendering relies on (sglang-router
    0.3.2): `--retry-max-retries N` makes at most N attempts of a request that trips the gate
    (each a new prefill and decode), so the operator renders retries + 1. With both decodes
    tripping every request, each request costs exactly N trips and reaches the client as 503."""
    attempts = 3
    f = Fleet(prefills=1, decodes=2, speedup=20.0, log_dir=tmp_path,
              router_args=["--retry-max-retries", str(attempts)])  # fmt: skip
    f.start()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for url in f.decode_urls:
                await _set_fault(s, url, {"repetition": 1.0})
            trips0 = await _scrape(s, f.decode_urls, "cas_guard_trips_total")
            results = [await _post(s, f"{f.router_url}/v1/chat/completions", _chat(f"j{i}", 200))
                       for i in range(3)]  # fmt: skip
            trips = await _scrape(s, f.decode_urls, "cas_guard_trips_total") - trips0
    finally:
        f.stop()
    assert [status for status, _ in results] == [503, 503, 503]
    assert trips == attempts * len(results)


async def test_metrics_match_traffic(fleet: Fleet) -> None:
    """Regression: prompt/generation counters and request counts equal what was sent."""
    n, max_tokens = 8, 25
    urls_d, urls_p = fleet.decode_urls, fleet.prefill_urls
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        gen0 = await _scrape(s, urls_d, "sglang:generation_tokens_total")
        req_p0 = await _scrape(s, urls_p, "sglang:num_requests_total")
        prompt_p0 = await _scrape(s, urls_p, "sglang:prompt_tokens_total")
        ttft0 = await _scrape(s, urls_d, "sglang:time_to_first_token_seconds_count")
        results = await asyncio.gather(
            *[
                _post(s, f"{fleet.router_url}/v1/chat/completions", _chat(f"count {i}", max_tokens))
                for i in range(n)
            ]
        )
        bodies = [json.loads(t) for st, t in results if st == 200]
        assert len(bodies) == n
        gen = await _scrape(s, urls_d, "sglang:generation_tokens_total") - gen0
        req_p = await _scrape(s, urls_p, "sglang:num_requests_total") - req_p0
        prompt_p = await _scrape(s, urls_p, "sglang:prompt_tokens_total") - prompt_p0
        ttft = await _scrape(s, urls_d, "sglang:time_to_first_token_seconds_count") - ttft0
        async with s.get(f"{urls_d[0]}/metrics") as resp:
            exposition = await resp.text()
    assert gen == sum(b["usage"]["completion_tokens"] for b in bodies) == n * max_tokens
    assert prompt_p == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert req_p == n and ttft == n
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:spec_accept_length",
        "sglang:spec_accept_rate",
        "sglang:cache_hit_rate",
        "sglang:num_aborted_requests_total",
        "sglang:inter_token_latency_seconds_count",
        "cas_kv_quarantined_slots",
        "cas_guard_trips_total",
    ):
        assert re.search(rf"^{re.escape(name)}", exposition, re.M), name


async def _race_traffic(router: str, n: int) -> list[tuple[int, str]]:
    sem = asyncio.Semaphore(16)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

        async def one(i: int) -> tuple[int, str]:
            async with sem:
                return await _post(
                    s,
                    f"{router}/v1/chat/completions",
                    _chat(f"agent step {i} " * 4, 400, stream=True),
                )

        return await asyncio.gather(*[one(i) for i in range(n)])


async def _stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(f"{url}/sim/stats") as r:
        stats: dict[str, Any] = (await r.json())["stats"]
        return stats


@pytest.mark.usefixtures("scheduler_priority")
async def test_stalled_prefill_corrupts_immediate_reclaim_but_not_strict(tmp_path: Path) -> None:
    """Regression (GLM-5 bug 1): with a prefill whose KV writes stall past the decode's budget,
    the decode with ``Immediate`` reclaim reuses slots under in-flight writes (garbled output,
    guard trips); the decode with ``Strict`` reclaim, fed the same traffic, shows none."""
    decode = ["--sim-prefill-budget", "2"]
    fleet = Fleet(
        prefills=1,
        decodes=2,
        speedup=5.0,  # budget 0.4 s, stall 0.8 s of wall time: robust on a loaded machine
        log_dir=tmp_path,
        decode_args=[
            [*decode, "--sim-kv-reclaim", "Immediate"],
            [*decode, "--sim-kv-reclaim", "Strict"],
        ],
        router_args=["--disable-circuit-breaker"],
    )
    with fleet:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for i in range(4):  # open the transfer connections to both decodes first
                status, text = await _post(
                    s, f"{fleet.router_url}/v1/chat/completions", _chat(f"warm {i}", 4)
                )
                assert status == 200, text
            await _set_fault(s, fleet.prefill_urls[0], {"kv_write_stall": "0.3:4"})
        results = await _race_traffic(fleet.router_url, 64)
        immediate = await _stats(fleet.decode_urls[0])
        strict = await _stats(fleet.decode_urls[1])
    garbled_streams = [t for st, t in results if st == 200 and any(g in t for g in GARBLE)]
    seen = f"immediate={immediate} strict={strict} garbled={len(garbled_streams)}"
    assert immediate["kv_corrupted"] >= 1 and garbled_streams, seen
    assert immediate["guard_trips"] >= 1, seen
    assert any("cas_guard_tripped" in t for t in garbled_streams), seen
    assert strict["kv_timeouts"] >= 1, f"no abort on the strict decode, vacuous: {seen}"
    assert strict["kv_corrupted"] == 0 and strict["guard_trips"] == 0, seen
    assert strict["kv_quarantined_slots"] == 0 and strict["kv_free_slots"] > 0, seen


async def test_load_generator_multi_turn_sessions_hit_prefix_cache(fleet: Fleet) -> None:
    """Regression: the agent workload's growing shared prefixes must hit the prefill's prefix
    cache, pass the router's OpenAI validation (tool calls) and stay bounded in requests."""
    from cas_engine.sim.load import Workload, run_load, summarize

    wl = Workload(
        sessions=4,
        system_tokens=1000,
        repo_tokens=1000,
        tool_tokens=200,
        max_context=8000,
        output_tokens=40,
        tool_pause_s=0.2,
        speedup=20.0,
    )
    totals, wall = await run_load(
        fleet.router_url, wl, max_requests=16, duration_s=20.0, progress=False
    )
    res = summarize(totals, wall, {})
    assert totals.done == 16 and totals.errors == 0, totals.error_kinds
    assert res["prefix_cache_hit_rate"] > 0.5
    assert len(totals.ttft) == 16 and res["ttft_ms"]["p50"] > 0


async def test_completions_and_streaming_generate_through_router(fleet: Fleet) -> None:
    """Regression: /v1/completions and streaming /generate pass the router unchanged."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, text = await _post(
            s,
            f"{fleet.router_url}/v1/completions",
            {"model": "sim", "prompt": "import os\n", "max_tokens": 12},
        )
        assert status == 200, text
        body = json.loads(text)
        assert body["object"] == "text_completion" and body["choices"][0]["text"]
        assert body["usage"]["completion_tokens"] == 12
        status, text = await _post(
            s,
            f"{fleet.router_url}/generate",
            {"text": "class A:", "stream": True, "sampling_params": {"max_new_tokens": 20}},
        )
    assert status == 200, text
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert last["text"].startswith(events[0]["text"])  # cumulative text, as SGLang streams it


async def test_corrupted_kv_transfer_garbles_stream_and_trips_guard(fleet: Fleet) -> None:
    """Regression: KV that arrives corrupted must be detected by the decode's content check,
    collapse the accept length (garbled text) and end the stream with the guard's error."""
    prefill = fleet.prefill_urls[0]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        before = await _scrape(s, fleet.decode_urls, "cas_sim_kv_corrupted_requests_total")
        await _set_fault(s, prefill, {"corruption": 1.0})
        try:
            status, text = await _post(
                s, f"{fleet.router_url}/v1/chat/completions", _chat("corrupt me", 300, stream=True)
            )
        finally:
            await _set_fault(s, prefill, {"corruption": 0.0})
        after = await _scrape(s, fleet.decode_urls, "cas_sim_kv_corrupted_requests_total")
    assert status == 200, text
    assert after - before == 1
    assert any(g in text for g in GARBLE)
    errors = [e for e in _sse_events(text) if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["cas_guard"]["reason"] == "low_accept_length"


async def test_client_disconnect_frees_decode_kv_slot(fleet: Fleet) -> None:
    """Regression: a client that drops a stream mid-way must end the request on the decode
    (the router closes its upstream stream in turn) and must not leak its KV slot."""
    before = [await _stats(u) for u in fleet.decode_urls]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(
            f"{fleet.router_url}/v1/chat/completions",
            json=_chat("long answer, then hang up", 20000, stream=True),
        ) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the stream started; drop it
        for _ in range(50):  # bounded: 5 s, well before 20000 tokens could be generated
            stats = [await _stats(u) for u in fleet.decode_urls]
            if all(st["running"] == 0 and st["kv_free_slots"] == 512 for st in stats):
                break
            await asyncio.sleep(0.1)
    aborted = sum(a["aborted"] - b["aborted"] for a, b in zip(stats, before, strict=True))
    generated = sum(
        a["generated_tokens"] - b["generated_tokens"] for a, b in zip(stats, before, strict=True)
    )
    assert aborted == 1 and generated < 20000, stats
    assert all(st["running"] == 0 and st["kv_free_slots"] == 512 for st in stats), stats
