"""Quality gate: synthetic accept streams with exact expected verdicts.

Each stream is a list of (accepted, proposed) draft counts per verify step for one request;
the expected trip step is derived from the rule (generated > 128, accept length < 1.4 or
accept rate > 0.96, strict), not read back from the implementation.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from cas_engine.guard import (
    GuardConfig,
    GuardMetrics,
    GuardMonitor,
    GuardTrip,
    add_guard_arguments,
    error_body,
    guard_config_from_args,
    http_response,
    sse_error_event,
)

Step = tuple[float, float]


def run_stream(
    steps: list[Step], config: GuardConfig | None = None, monitor: GuardMonitor | None = None
) -> tuple[int | None, GuardTrip | None, GuardMonitor, int]:
    """Feed one request step by step; return (1-based trip step, trip, monitor, slot)."""
    mon = monitor or GuardMonitor(config or GuardConfig(), capacity=4)
    slot = mon.allocate("req-under-test")
    for i, (a, p) in enumerate(steps, start=1):
        trip = mon.observe_one(slot, a, p)
        if trip is not None:
            return i, trip, mon, slot
    return None, None, mon, slot


def cycle(pattern: list[int], proposed: int, n: int) -> list[Step]:
    return [(float(pattern[i % len(pattern)]), float(proposed)) for i in range(n)]


def test_healthy_stream_never_trips() -> None:
    """Regression: a normal request (accept length 3.0, rate 0.67) must never be aborted."""
    step, trip, mon, slot = run_stream(cycle([2, 1, 3, 2], 3, 400))
    assert step is None and trip is None
    st = mon.stats(slot)
    assert st.checked and not st.tripped
    assert st.accept_length == pytest.approx(3.0)
    assert st.accept_rate == pytest.approx(2 / 3)


def test_corrupted_stream_trips_on_first_judged_step() -> None:
    """Regression: draft/target disagreement (accept length 1.0) trips once > 128 tokens."""
    step, trip, _, _ = run_stream(cycle([0], 3, 400))
    # each step generates accepted + 1 = 1 token, so step 129 is the first with > 128
    assert step == 129
    assert trip is not None
    assert (trip.reason, trip.scope, trip.generated_tokens) == ("low_accept_length", "request", 129)
    assert trip.accept_length == 1.0 and trip.accept_rate == 0.0


def test_repetitive_stream_trips_high_accept_rate() -> None:
    """Regression: degenerate repetition (every draft accepted) trips high_accept_rate."""
    step, trip, _, _ = run_stream(cycle([3], 3, 100))
    # 4 tokens per step: step 32 reaches exactly 128 (not > 128), step 33 reaches 132
    assert step == 33
    assert trip is not None
    assert (trip.reason, trip.generated_tokens) == ("high_accept_rate", 132)
    assert trip.accept_rate == 1.0 and trip.accept_length == 4.0


def test_short_request_is_never_judged() -> None:
    """Regression: requests of <= 128 tokens are not judged, however bad their statistics."""
    step, trip, mon, slot = run_stream(cycle([0], 3, 128))
    assert step is None and trip is None
    assert not mon.stats(slot).checked
    step, _, _, _ = run_stream(cycle([3], 3, 32))  # 128 tokens, rate 1.0
    assert step is None


@pytest.mark.parametrize("window", [0, 50])
def test_borderline_values_equal_to_thresholds_do_not_trip(window: int) -> None:
    """Regression: thresholds are strict (< 1.4, > 0.96); exactly equal must pass."""
    cfg = GuardConfig(window=window)
    # mean accepted 0.4 per step -> accept length exactly 1.4, never below at any prefix
    step, _, mon, slot = run_stream(cycle([1, 0, 1, 0, 0], 3, 500), cfg)
    assert step is None
    assert mon.stats(slot).accept_length == 1.4
    # 24 of 25 drafts accepted -> accept rate exactly 0.96, never above at any prefix
    step, _, mon, slot = run_stream(cycle([4, 5, 5, 5, 5], 5, 300), cfg)
    assert step is None
    assert mon.stats(slot).accept_rate == 0.96


def test_borderline_values_just_past_thresholds_trip() -> None:
    """Regression: the same borderline streams trip once the threshold moves by 1e-9."""
    cfg = GuardConfig(min_accept_length=1.4 + 1e-9, window=0)
    step, trip, _, _ = run_stream(cycle([1, 0, 1, 0, 0], 3, 500), cfg)
    # first step with > 128 tokens at which the prefix mean is exactly 0.4: step 95 gives 133
    assert trip is not None and trip.reason == "low_accept_length" and step == 95
    cfg = GuardConfig(max_accept_rate=0.96 - 1e-9, window=0)
    step, trip, _, _ = run_stream(cycle([4, 5, 5, 5, 5], 5, 300), cfg)
    assert trip is not None and trip.reason == "high_accept_rate"
    assert step == 25  # 25 steps * 5.8 tokens = 145 > 128, and 25 is a multiple of 5


def test_nan_and_invalid_steps_are_ignored_and_counted() -> None:
    """Regression: a NaN (or impossible) step must neither trip nor poison the statistics."""
    reg = CollectorRegistry()
    cfg = GuardConfig()
    mon = GuardMonitor(cfg, capacity=2, metrics=GuardMetrics.create(reg, cfg))
    bad: list[Step] = [(math.nan, 3), (1, math.nan), (-1, 3), (4, 3), (math.inf, 3)]
    stream = cycle([2], 3, 100)
    for i, b in enumerate(bad):
        stream.insert(10 * i + 5, b)
    step, _, mon, slot = run_stream(stream, monitor=mon)
    assert step is None
    st = mon.stats(slot)
    assert (st.verify_steps, st.generated_tokens, st.accepted) == (100, 300, 200)
    assert reg.get_sample_value("cas_guard_invalid_steps_total") == len(bad)
    # a stream of only NaN never becomes eligible
    step, _, mon2, slot2 = run_stream([(math.nan, math.nan)] * 300)
    assert step is None and mon2.stats(slot2).generated_tokens == 0


def test_zero_draft_steps_add_tokens_but_no_statistics() -> None:
    """Regression: steps without drafts must not drag accept length down to 1.0."""
    stream: list[Step] = [(0, 0)] * 200
    step, _, mon, slot = run_stream(stream)
    assert step is None and not mon.stats(slot).checked  # no speculative step: not judged
    stream = [(0, 0)] * 100 + cycle([2], 3, 20)
    step, _, mon, slot = run_stream(stream)
    st = mon.stats(slot)
    assert step is None and st.checked
    assert (st.generated_tokens, st.verify_steps, st.accept_length) == (160, 20, 3.0)


def test_window_catches_corruption_after_a_healthy_start() -> None:
    """Regression: corruption mid-request is caught by the window before the cumulative mean."""
    w = 32
    stream = cycle([2], 3, 100) + cycle([0], 3, 100)
    step, trip, _, _ = run_stream(stream, GuardConfig(window=w))
    # after j corrupted steps the window mean accepted is 2 * (w - j) / w; first j with
    # 1 + 2 * (w - j) / w < 1.4 is j = 26
    j = next(j for j in range(1, w + 1) if 1 + 2 * (w - j) / w < 1.4)
    assert step == 100 + j
    assert trip is not None and (trip.reason, trip.scope) == ("low_accept_length", "window")
    assert trip.accept_length > 1.4
    step, _, _, _ = run_stream(stream, GuardConfig(window=0))
    assert step is None or step > 100 + j  # cumulative only: later or never


def test_tripped_request_is_not_judged_again_and_slot_reuse_resets() -> None:
    """Regression: one trip per request; a reused slot starts from empty statistics."""
    mon = GuardMonitor(GuardConfig(), capacity=1)
    step, trip, mon, slot = run_stream(cycle([0], 3, 200), monitor=mon)
    assert step == 129 and trip is not None
    assert mon.observe([slot], [0], [3]) == []
    assert mon.finish(slot) is not None
    assert mon.allocate("next") == slot
    assert mon.stats(slot).generated_tokens == 0 and mon.request_id(slot) == "next"


def test_disabled_gate_observes_but_never_trips() -> None:
    """Regression: enabled=false (observe mode) must count checks without aborting."""
    step, _, mon, slot = run_stream(cycle([0], 3, 300), GuardConfig(enabled=False))
    assert step is None and mon.stats(slot).checked


def _reference_trip_step(steps: list[Step], cfg: GuardConfig) -> tuple[int | None, str | None]:
    """Scalar re-statement of the rules, step by step in plain Python."""
    gen = acc = prop = n = 0
    win: list[tuple[int, int]] = []
    for i, (a, p) in enumerate(steps, start=1):
        gen += int(a) + 1
        if p > 0:
            acc, prop, n = acc + int(a), prop + int(p), n + 1
            win = ([*win, (int(a), int(p))])[-cfg.window :] if cfg.window else []
        if gen <= cfg.min_generated_tokens or n == 0:
            continue
        full = cfg.window > 0 and len(win) == cfg.window
        wa, wp = sum(x for x, _ in win), sum(y for _, y in win)
        if (acc + n) / n < cfg.min_accept_length or (
            full and (wa + cfg.window) / cfg.window < cfg.min_accept_length
        ):
            return i, "low_accept_length"
        if acc / prop > cfg.max_accept_rate or (full and wa / wp > cfg.max_accept_rate):
            return i, "high_accept_rate"
    return None, None


def test_vectorised_batch_matches_scalar_reference() -> None:
    """Regression: batching many requests in one observe() changes no request's verdict."""
    rng = np.random.default_rng(7)
    cfg = GuardConfig(window=16)
    n_req, n_steps, k = 64, 120, 4
    quality = rng.uniform(0.0, 1.0, size=n_req)  # per-request acceptance probability
    acc = rng.binomial(k, np.repeat(quality[:, None], n_steps, axis=1)).astype(float)
    prop = np.full_like(acc, k)
    prop[rng.random(acc.shape) < 0.05] = 0  # some zero-draft steps
    acc[prop == 0] = 0
    mon = GuardMonitor(cfg, capacity=n_req * 2)
    slots = np.array([mon.allocate(f"r{i}") for i in range(n_req)])
    got: dict[str, tuple[int, str]] = {}
    for t in range(n_steps):
        for trip in mon.observe(slots, acc[:, t], prop[:, t]):
            got[trip.request_id] = (t + 1, trip.reason)
    expected = {}
    for i in range(n_req):
        step, reason = _reference_trip_step(list(zip(acc[i], prop[i], strict=True)), cfg)
        if step is not None:
            expected[f"r{i}"] = (step, reason)
    assert got == expected
    assert 0 < len(expected) < n_req  # the draw exercises both verdicts


def test_metrics_count_trips_checks_and_completion_histograms() -> None:
    """Regression: the operator's anomaly rate and baseline come from these exact series."""
    reg = CollectorRegistry()
    cfg = GuardConfig()
    mon = GuardMonitor(cfg, capacity=8, metrics=GuardMetrics.create(reg, cfg))
    for stream in (cycle([2], 3, 100), cycle([0], 3, 200), cycle([3], 3, 50), cycle([0], 3, 10)):
        _, _, _, slot = run_stream(stream, monitor=mon)
        mon.finish(slot)
    val = reg.get_sample_value
    assert val("cas_guard_trips_total", {"reason": "low_accept_length"}) == 1
    assert val("cas_guard_trips_total", {"reason": "high_accept_rate"}) == 1
    assert val("cas_guard_requests_checked_total") == 3  # the 10-token request is not checked
    assert val("cas_guard_accept_length_count") == 3
    assert val("cas_guard_accept_length_sum") == pytest.approx(3.0 + 1.0 + 4.0)
    assert val("cas_guard_accept_rate_bucket", {"le": "0.96"}) == 2
    assert (
        val(
            "cas_guard_config_info",
            {
                "min_accept_length": "1.4",
                "max_accept_rate": "0.96",
                "min_generated_tokens": "128",
                "window": "32",
                "enabled": "true",
                "repetition_period": "48",
            },
        )
        == 1
    )
    assert val("cas_guard_config_value", {"parameter": "min_accept_length"}) == 1.4
    assert val("cas_guard_config_value", {"parameter": "enabled"}) == 1.0


def test_trip_outcomes_are_retryable_503_and_sse_error() -> None:
    """Regression: the router retries only 503-class answers; the body must name the reason."""
    _, trip, _, _ = run_stream(cycle([0], 3, 200))
    assert trip is not None
    status, headers, body = http_response(trip)
    assert status == 503 and headers["Retry-After"] == "0"
    err = json.loads(body)["error"]
    assert err["code"] == 503 and err["type"] == "cas_guard_tripped"
    assert err["cas_guard"]["reason"] == "low_accept_length" and err["cas_guard"]["retryable"]
    assert err["cas_guard"]["request_id"] == "req-under-test"
    assert "low_accept_length" in err["message"]
    event = sse_error_event(trip).decode()
    first, done = event.split("\n\n")[:2]
    assert first.startswith("data: ") and done == "data: [DONE]"
    assert json.loads(first[len("data: ") :]) == error_body(trip)


def test_error_body_is_valid_json_with_nan_statistics() -> None:
    """Regression: NaN statistics (no full window) must not produce invalid JSON."""
    _, trip, _, _ = run_stream(cycle([0], 3, 200), GuardConfig(window=0))
    assert trip is not None and math.isnan(trip.window_accept_length)
    body = http_response(trip)[2].decode()
    assert (
        "NaN" not in body and json.loads(body)["error"]["cas_guard"]["window_accept_rate"] is None
    )


def test_config_from_env_and_cli_precedence() -> None:
    """Regression: operator-passed env vars apply, explicit CLI flags override them."""
    env = {
        "CAS_GUARD_MIN_ACCEPT_LENGTH": "1.6",
        "CAS_GUARD_WINDOW": "8",
        "CAS_GUARD_ENABLED": "false",
    }
    assert GuardConfig.from_env(env) == GuardConfig(min_accept_length=1.6, window=8, enabled=False)
    parser = argparse.ArgumentParser()
    add_guard_arguments(parser)
    ns = parser.parse_args(["--cas-guard-window", "4", "--cas-guard-max-accept-rate", "0.9"])
    cfg = guard_config_from_args(ns, env)
    assert cfg == GuardConfig(min_accept_length=1.6, window=4, max_accept_rate=0.9, enabled=False)


@pytest.mark.parametrize(
    "env",
    [
        {"CAS_GUARD_MAX_ACCEPT_RATE": "1.5"},
        {"CAS_GUARD_WINDOW": "-1"},
        {"CAS_GUARD_MIN_ACCEPT_LENGTH": "nan"},
        {"CAS_GUARD_ENABLED": "maybe"},
        {"CAS_GUARD_MIN_GENERATED_TOKENS": "12.5"},
    ],
)
def test_config_rejects_invalid_values(env: dict[str, str]) -> None:
    """Regression: a typo in the resource must fail the pod start, not disable the gate."""
    with pytest.raises(ValueError):
        GuardConfig.from_env(env)


# ---- the repetition rule: a high accept rate trips only with repeating output ----


def _ids(text: str) -> list[int]:
    from cas_engine.sim.textgen import _WORD, token_id

    return [token_id(w) for w in _WORD.findall(text)]


def test_short_period_finds_a_repeated_phrase_and_not_copied_code() -> None:
    from cas_engine.guard.repetition import short_period

    assert short_period(_ids("the same line again\n" * 60)) == 5
    code = (Path(__file__).resolve().parents[2] / "engine/cas_engine/guard/monitor.py").read_text()
    copied = _ids(code)
    assert all(short_period(copied[i : i + 200]) is None for i in range(0, 2000, 200))
    assert short_period(_ids("again " * 20)) is None  # too few tokens to tell


def test_a_verbatim_copy_is_kept_and_repetition_still_trips() -> None:
    """Regression (issue 13): "accept rate > 0.96" aborted healthy output a draft model predicts
    nearly token for token (a copied file: 100% of such requests in bench.guard_calibration).
    With the request's own tokens the gate asks for a short period as well; the copy is kept
    (counted once), degenerate repetition still trips, and a caller without tokens keeps the
    rate-alone rule."""
    registry = CollectorRegistry()
    cfg = GuardConfig()
    mon = GuardMonitor(cfg, 2, metrics=GuardMetrics.create(registry, cfg))
    code = (Path(__file__).resolve().parents[2] / "engine/cas_engine/guard/config.py").read_text()
    a, b = mon.allocate("copy"), mon.allocate("loop")
    outputs = {a: _ids(code), b: _ids("the same line again\n" * 100)}
    tripped = {
        trip.request_id
        for step in range(1, 61)
        for trip in mon.observe([a, b], [3, 3], 3, lambda s, n=4 * step: outputs[s][:n])
    }
    assert tripped == {"loop"}
    assert registry.get_sample_value("cas_guard_high_accept_kept_total") == 1.0
    rate_alone = GuardMonitor(cfg, 1)
    slot = rate_alone.allocate("no tokens")
    assert any(rate_alone.observe_one(slot, 3, 3) is not None for _ in range(60))
