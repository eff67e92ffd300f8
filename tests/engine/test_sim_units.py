"""Sim engine parts in-process: prefix cache, text generator, faults, CLI, timing, one worker.

Guards: hit rates that do not come from shared prefixes, eviction that drops a live prefix,
replays that change, fault specs that parse wrongly, SGLang arguments that crash the CLI, the
``null``-mode worker's API shapes and metrics, the guard tripping on repetition, and the hang /
crash faults.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from cas_engine.guard import GuardConfig, GuardMonitor
from cas_engine.sim.config import build_parser, parse_args
from cas_engine.sim.faults import parse_faults
from cas_engine.sim.fleet import ephemeral_low, free_port
from cas_engine.sim.prefix_cache import PrefixCache
from cas_engine.sim.server import SimServer
from cas_engine.sim.textgen import TokenStream, request_seed, tokenize
from cas_engine.sim.timing import TimingParams, decode_step_seconds, prefill_seconds
from cas_engine.sim.worker import (
    REPEAT_ACCEPT_PROB,
    REPEAT_JUDGED_BY_TOKENS,
    SimWorker,
    accepted_drafts,
)

pytestmark = pytest.mark.timeout(60)


def _toks(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype="<u4")


def test_prefix_cache_hits_only_shared_full_blocks() -> None:
    """Regression: a multi-turn prompt hits exactly the full blocks of its earlier turn."""
    cache = PrefixCache(block_size=16, capacity_tokens=10_000)
    turn1 = _toks(100)
    assert cache.match_and_insert(turn1) == 0
    turn2 = np.concatenate([turn1, _toks(50, 1000)])
    assert cache.match_and_insert(turn2) == 96  # 6 full blocks of turn 1
    other = _toks(100, 5000)
    assert cache.match_and_insert(other) == 0
    assert cache.hit_tokens == 96 and cache.total_tokens == 100 + 150 + 100


def test_prefix_cache_evicts_leaves_first_and_respects_capacity() -> None:
    """Regression: eviction keeps a shared prefix while dropping cold suffixes."""
    cache = PrefixCache(block_size=10, capacity_tokens=100)
    shared = _toks(50)
    for i in range(5):
        cache.match_and_insert(np.concatenate([shared, _toks(30, 100 * (i + 1))]))
        cache.match_and_insert(shared)  # keep the shared prefix hot
    assert cache.cached_tokens <= 100
    assert cache.match_and_insert(shared) == 50


def test_prefix_cache_is_an_exact_lru_over_blocks() -> None:
    """Regression (issue 40): a prefix used again while a longer prompt held it was evicted
    next once that prompt's tail went, before blocks used longer ago (a node that became a
    leaf was put first in line), so the sims' hit rates sat below the exact LRU the replay's
    bound computes. Now every block of a prompt is used when the prompt is."""
    cache = PrefixCache(block_size=10, capacity_tokens=30)
    a, b, d, e, f = (_toks(10, 100 * k) for k in range(1, 6))
    cache.match_and_insert(np.concatenate([a, b]))  # a, b
    cache.match_and_insert(d)  # a, b, d: full
    assert cache.match_and_insert(a) == 10  # a used again: now newer than d
    cache.match_and_insert(e)  # b goes (least recently used)
    cache.match_and_insert(f)  # d goes, not a
    assert cache.cached_tokens == 30
    assert cache.match_and_insert(a) == 10
    assert cache.match_and_insert(d) == 0
    # among one prompt's blocks the deepest goes first: what stays keeps its prefix
    long = _toks(40, 5000)
    cache.match_and_insert(long)
    assert cache.match_and_insert(long) == 30


def test_token_stream_is_deterministic_and_seeded_by_prompt() -> None:
    """Regression: replays equal, different prompts differ, styles keep alignment."""
    seed = request_seed(tokenize("hello"), None, 0)
    a, b = TokenStream(seed), TokenStream(seed)
    assert a.take(50) == b.take(50)
    c = TokenStream(request_seed(tokenize("hello!"), None, 0))
    assert c.take(50) != TokenStream(seed).take(50)
    assert request_seed(tokenize("x"), 1, 0) != request_seed(tokenize("x"), 2, 0)


def test_tokenize_is_four_byte_chunks() -> None:
    assert len(tokenize("abcdefgh")) == 2 and len(tokenize("abcde")) == 2
    assert tokenize("abcd")[0] == int.from_bytes(b"abcd", "little")


def test_fault_spec_parsing_and_errors() -> None:
    """Regression: every fault in the documented spec parses; unknown names are rejected."""
    f = parse_faults(
        "kv_write_stall=0.25:3,corruption=0.01,repetition=0.5,slow_decode=2,slow_prefill=3,hang=1"
    )
    assert (f.kv_write_stall_rate, f.kv_write_stall_s) == (0.25, 3.0)
    assert f.corruption_rate == 0.01 and f.repetition_rate == 0.5
    assert f.slow_decode == 2.0 and f.slow_prefill == 3.0 and f.hang and not f.crash
    assert parse_faults("decode_corruption=0.25").decode_corruption == 0.25
    f.apply({"hang": False, "corruption": 0})
    assert not f.hang and f.corruption_rate == 0
    with pytest.raises(ValueError):
        parse_faults("explode=1")
    with pytest.raises(ValueError):
        parse_faults("corruption=2")


def test_cli_ignores_unknown_sglang_args_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: the operator's real SGLang pod arguments must not crash the sim."""
    with caplog.at_level(logging.INFO, logger="cas_engine.sim"):
        cfg = parse_args(
            [
                "--disaggregation-mode",
                "decode",
                "--tp",
                "8",
                "--trust-remote-code",
                "--mem-fraction-static",
                "0.85",
                "--enable-dsa-cache-layer-split",
                "--sim-speedup",
                "5",
                "--cas-guard-min-accept-length",
                "1.5",
            ]
        )
    lines = [r for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and "--trust-remote-code" in lines[0].getMessage()
    assert cfg.mode == "decode" and cfg.tp_size == 8 and cfg.speedup == 5.0
    assert cfg.guard_args is not None and cfg.guard_args.cas_guard_min_accept_length == 1.5
    assert "simulat" in build_parser().format_help().lower()


def test_timing_model_monotonic() -> None:
    """Regression: cached tokens are cheaper, longer contexts and larger batches are slower."""
    p = TimingParams()
    assert prefill_seconds(p, 1000, 70_000) > prefill_seconds(p, 1000, 2_000)
    assert prefill_seconds(p, 7_000, 70_000) < prefill_seconds(p, 70_000, 70_000)
    assert decode_step_seconds(p, 256, 0) > decode_step_seconds(p, 1, 0)
    # calibration sanity: ~50k uncached tokens/s at short context
    assert 0.5 < prefill_seconds(p, 50_000, 50_000) < 2.0


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    cfg = parse_args(
        [
            "--sim-speedup",
            "50",
            "--served-model-name",
            "glm-sim",
            "--cas-guard-min-generated-tokens",
            "64",
        ]
    )
    worker = SimWorker(cfg)
    await worker.start()
    server = TestServer(SimServer(cfg, worker).app())
    async with TestClient(server) as c:
        c.worker = worker  # type: ignore[attr-defined]
        yield c
    await worker.stop()


async def test_null_mode_endpoints_and_info(client: TestClient) -> None:
    """Regression: info endpoints say what the router reads; every response is marked."""
    for path in (
        "/health",
        "/health_generate",
        "/get_server_info",
        "/server_info",
        "/get_model_info",
        "/model_info",
        "/v1/models",
        "/metrics",
    ):
        resp = await client.get(path)
        assert resp.status == 200, path
        assert resp.headers["X-Simulated-Engine"] == "cas_engine.sim"
    info = await (await client.get("/server_info")).json()
    assert info["disaggregation_mode"] == "null" and info["simulated"] is True
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "glm-sim"


async def test_completions_stream_and_prefix_cache_metrics(client: TestClient) -> None:
    """Regression: text completions stream; the second turn hits the prefix cache."""
    prompt = "x" * 4096
    r1 = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10})
    b1 = await r1.json()
    assert b1["object"] == "text_completion" and b1["usage"]["completion_tokens"] == 10
    r2 = await client.post(
        "/v1/completions", json={"prompt": prompt + " more", "max_tokens": 5, "stream": True}
    )
    text = await r2.text()
    assert text.rstrip().endswith("data: [DONE]")
    pieces = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"
    metrics = await (await client.get("/metrics")).text()
    hit = [ln for ln in metrics.splitlines() if ln.startswith("sglang:cache_hit_rate{")]
    assert hit and 0.4 < float(hit[0].split()[-1]) < 0.6  # turn 2 fully cached, turn 1 not


async def test_repetition_fault_trips_guard_with_retryable_503(client: TestClient) -> None:
    """Regression: degenerate repetition must abort via the guard (503, retryable body)."""
    worker: SimWorker = client.worker  # type: ignore[attr-defined]
    resp = await client.post("/sim/fault", data="repetition=1")
    assert resp.status == 200
    resp = await client.post(
        "/generate", json={"text": "loop", "sampling_params": {"max_new_tokens": 300}}
    )
    assert resp.status == 503 and resp.headers["Retry-After"] == "0"
    body = await resp.json()
    assert body["error"]["type"] == "cas_guard_tripped"
    assert body["error"]["cas_guard"]["reason"] == "high_accept_rate"
    assert worker.stats["guard_trips"] == 1
    await client.post("/sim/fault", json={"repetition": 0})
    ok = await client.post(
        "/generate", json={"text": "loop", "sampling_params": {"max_new_tokens": 300}}
    )
    assert ok.status == 200


async def test_hang_fault_blocks_health_until_cleared(client: TestClient) -> None:
    """Regression: ``hang`` must make the worker unresponsive (health probes time out)."""
    await client.post("/sim/fault", json={"hang": True})
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(client.get("/health"), 0.3)
    await client.post("/sim/fault", json={"hang": False})
    assert (await client.get("/health")).status == 200


async def test_health_takes_as_long_as_sglangs_and_the_bootstrap_health_does_not() -> None:
    """Regression (engine probes without a timeout): the sim answered /health at once while
    SGLang's takes over a second, so the local stack could not show a probe that gives up
    sooner. With `--sim-health-delay` /health and /health_generate take it; the bootstrap
    server's /health (the decode's heartbeat to a prefill) still answers at once."""
    cfg = parse_args(["--sim-health-delay", "0.4", "--disaggregation-mode", "prefill",
                      "--disaggregation-bootstrap-port", "0"])  # fmt: skip
    worker = SimWorker(cfg)
    await worker.start()
    server = SimServer(cfg, worker)
    try:
        async with TestClient(TestServer(server.app())) as main:
            for path in ("/health", "/health_generate"):
                start = time.monotonic()
                assert (await main.get(path)).status == 200
                assert time.monotonic() - start >= 0.4, path
        async with TestClient(TestServer(server.bootstrap_app())) as bootstrap:
            start = time.monotonic()
            assert (await bootstrap.get("/health")).status == 200
            assert time.monotonic() - start < 0.3
    finally:
        await worker.stop()


async def test_many_concurrent_streams_complete(client: TestClient) -> None:
    """Regression: a batch of 64 concurrent streams all complete with their token counts."""

    async def one(i: int) -> int:
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": f"s{i}"}],
                "max_tokens": 40,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        text = await resp.text()
        usage = [
            json.loads(ln[6:])
            for ln in text.splitlines()
            if ln.startswith("data: {") and '"usage"' in ln
        ]
        return int(usage[-1]["usage"]["completion_tokens"])

    counts = await asyncio.gather(*[one(i) for i in range(64)])
    assert counts == [40] * 64


def test_crash_fault_exits_process() -> None:
    """Regression: ``crash`` ends the worker process with exit code 70."""
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "cas_engine.sim", "--port", str(port), "--sim-fault", "crash=1"],
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 70


def test_cas_flags_from_operator_pods_select_reclaim_and_guard() -> None:
    """Regression: the operator's ``--cas-kv-reclaim`` / ``--cas-guard-enabled`` flags must take
    effect in the sim (``--sim-kv-reclaim`` > flag > ``CAS_KV_RECLAIM`` > Strict)."""
    cfg = parse_args(["--cas-kv-reclaim", "upstream", "--cas-guard-enabled", "false"], env={})
    assert cfg.kv_reclaim == "Upstream" and cfg.guard_enabled is False
    assert parse_args([], env={"CAS_KV_RECLAIM": "immediate"}).kv_reclaim == "Immediate"
    assert parse_args([], env={}).kv_reclaim == "Strict"
    both = ["--sim-kv-reclaim", "Immediate", "--cas-kv-reclaim", "strict"]
    assert parse_args(both, env={}).kv_reclaim == "Immediate"
    worker = SimWorker(parse_args(["--cas-guard-enabled", "false"], env={}))
    assert worker.guard.config.enabled is False


def test_prefill_budget_follows_the_operators_sglang_env() -> None:
    """Regression: the operator sets the prefill budget via SGLang's environment variables;
    the sim must use them unless a --sim-* flag overrides."""
    env = {
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "45",
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "12",
    }
    cfg = parse_args([], env=env)
    assert cfg.prefill_budget_s == 45.0 and cfg.upstream_release_timeout_s == 12.0
    assert parse_args(["--sim-prefill-budget", "2"], env=env).prefill_budget_s == 2.0
    assert parse_args([], env={}).prefill_budget_s == 300.0


async def test_pd_pair_in_process_over_http_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: without mooncake (CAS_SIM_KV_TRANSPORT=http) a prefill/decode pair still
    hands KV over, the way the router drives it (same body with bootstrap fields to both), and
    the decode's content check passes."""
    import aiohttp

    from cas_engine.sim.__main__ import serve

    monkeypatch.setenv("CAS_SIM_KV_TRANSPORT", "http")
    pp, bp, dp = free_port(), free_port(), free_port()
    common = ["--sim-speedup", "50", "--host", "127.0.0.1"]
    cfgs = [
        parse_args(
            [
                "--disaggregation-mode",
                "prefill",
                "--port",
                str(pp),
                "--disaggregation-bootstrap-port",
                str(bp),
                *common,
            ],
            env={},
        ),
        parse_args(["--disaggregation-mode", "decode", "--port", str(dp), *common], env={}),
    ]
    stop = asyncio.Event()
    readies = [asyncio.Event() for _ in cfgs]
    tasks = [asyncio.create_task(serve(c, r, stop)) for c, r in zip(cfgs, readies, strict=True)]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 20)
        body = {
            "text": "def main():",
            "sampling_params": {"max_new_tokens": 20},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bp,
            "bootstrap_room": 4242,
        }
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:

            async def post(port: int) -> tuple[int, dict]:
                async with s.post(f"http://127.0.0.1:{port}/generate", json=body) as r:
                    return r.status, await r.json()

            (sp, bprefill), (sd, bdecode) = await asyncio.gather(post(pp), post(dp))
            async with s.get(f"http://127.0.0.1:{dp}/sim/stats") as r:
                stats = (await r.json())["stats"]
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert sp == 200 and bprefill["meta_info"]["kv_transferred"] is True
    assert sd == 200 and bdecode["meta_info"]["completion_tokens"] == 20
    assert stats["kv_transport"] == "HttpTransport"
    assert stats["kv_corrupted"] == 0 and stats["kv_free_slots"] == 512


def test_a_fleet_never_hands_out_one_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (a fresh-clone CI run): `free_port` closes its probe socket, so the OS
    offered a decode the port its prefill had not bound yet ("address already in use")."""
    from cas_engine.sim import fleet as fleet_mod

    offered = iter([41000, 41000, 41001, 41000, 41002])
    monkeypatch.setattr(fleet_mod, "free_port", lambda host="127.0.0.1": next(offered))
    fleet = fleet_mod.Fleet(prefills=1, decodes=1)
    assert [fleet._port() for _ in range(3)] == [41000, 41001, 41002]


async def test_admin_key_guards_sglangs_admin_endpoints_as_sglang_decides() -> None:
    """The operator renders `--admin-api-key` on every engine pod; the sim then asks SGLang's
    own auth code (srt/utils/auth.py), so /flush_cache refuses a request without the key,
    with a wrong one and with the plain api key, while generation, health and metrics stay
    open (the router and Prometheus carry no key)."""
    cfg = parse_args(["--sim-speedup", "50", "--admin-api-key", "adm1n"])
    worker = SimWorker(cfg)
    await worker.start()
    try:
        async with TestClient(TestServer(SimServer(cfg, worker).app())) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "adm1n"}):
                resp = await c.post("/flush_cache", headers=headers)
                assert resp.status == 401, headers
            ok = await c.post("/flush_cache", headers={"Authorization": "Bearer adm1n"})
            assert ok.status == 200
            for path in ("/health", "/metrics", "/get_server_info", "/sim/stats"):
                assert (await c.get(path)).status == 200, path
            body = {"text": "def f():", "sampling_params": {"max_new_tokens": 4}}
            assert (await c.post("/generate", json=body)).status == 200
    finally:
        await worker.stop()


async def test_without_keys_nothing_is_guarded(client: TestClient) -> None:
    assert (await client.post("/flush_cache")).status == 200


def test_the_gate_judges_every_sim_repetition_before_its_last_token() -> None:
    """Regression (a CI failure of e2e test_real_router_with_kubernetes_discovery_loses_no_request):
    the e2e tests under a repetition fault assert that no client gets a repeating answer, and
    asked for 200 tokens. The gate judges a request only past 144 tokens, and the sim's loop
    accepts each draft with p 0.998: a few early rejections hold the accept rate at or under
    0.96 for the dozen steps a 200-token answer leaves (12 of 20,000 finished unjudged).
    Driven as the worker's decode step drives it (`accepted_drafts` of 3 drafts, every running
    request observed once per step with its own output), every seed's repetition of
    REPEAT_JUDGED_BY_TOKENS is aborted before its last token."""
    n, drafts, length = 4000, parse_args([]).spec_num_steps, REPEAT_JUDGED_BY_TOKENS
    monitor = GuardMonitor(GuardConfig(), n)
    slots = [monitor.allocate(f"loop-{seed}") for seed in range(n)]
    streams = {slot: TokenStream(seed) for seed, slot in enumerate(slots)}
    draws = {slot: random.Random(seed ^ 0x5EED) for seed, slot in enumerate(slots)}
    for stream in streams.values():
        stream.set_style("repeat")
    running, unjudged = set(slots), []
    while running:
        batch = sorted(running)
        accepted = []
        for slot in batch:
            acc = accepted_drafts(draws[slot], drafts, REPEAT_ACCEPT_PROB)
            streams[slot].take(min(acc + 1, length - streams[slot].count))
            accepted.append(acc)
        trips = monitor.observe(batch, accepted, drafts, lambda s: list(streams[s].ids))
        running -= {trip.slot for trip in trips}
        finished = {slot for slot in running if streams[slot].count >= length}
        unjudged += sorted(finished)
        running -= finished
    assert unjudged == [], f"{len(unjudged)} of {n} repetitions answered in full"


def test_free_port_is_below_the_kernels_ephemeral_range_and_bindable() -> None:
    """Regression: free_port let the OS pick (bind to 0), from the range the kernel also hands
    to outgoing connections; between its release and the router's own bind, one of the suite's
    connections took the port, the router exited 'Address already in use' and
    test_the_real_router_registers_a_pod_only_once_it_is_ready timed out."""
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(low - 8000 <= p < low for p in ports), (low, sorted(ports))
    assert len(ports) > 1  # picked at random, not one port for every caller
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_low_reads_the_range_file_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ephemeral_low(tmp_path / "range") == 40000
    assert ephemeral_low(tmp_path / "missing") == 32768
