"""SessionMix's defaults against the real Claude Code sessions (bench.fleetsim.calibration;
issue 39, part 3).

Guards: every synthetic scenario of the planner benchmark draws its sessions from
`SessionMix`'s defaults, which were invented (20 turns of 32K-token first prompts, 20 s
pauses, 400-token answers, 3,400 new tokens per turn, sessions ending at 180K). They must stay
shaped like the real sessions in ../shared/traces: per figure the mix's mean and median within
10% and 15% of the traces', its 90th percentile within 35% (a lognormal's tail against the
traces'), and the prompts the simulator's session process draws from it (what growth and the
end at `max_context` add up to) within 10% of the traces' in mean, median and p90."""

from __future__ import annotations

import functools

import pytest

from bench.fleetsim import SessionMix
from bench.fleetsim.calibration import Figure, measure, mix_figures, simulated_prompts
from bench.traces import read_claude_sessions
from tests.real_traces import CLAUDE_SESSIONS, require

MEAN_TOLERANCE = 0.10
MEDIAN_TOLERANCE = 0.15
P90_TOLERANCE = 0.35
PROMPT_TOLERANCE = 0.10


@functools.cache
def _measured() -> dict[str, Figure]:
    return measure(read_claude_sessions(require(CLAUDE_SESSIONS)))


def _off(mix: float, real: float) -> float:
    return abs(mix / real - 1.0)


@pytest.mark.parametrize("name", ["first_input", "new_tokens", "output", "think", "turns"])
def test_the_mix_defaults_are_the_real_sessions_figures(name: str) -> None:
    """One figure of the default mix (its mean, median, 90th percentile) against the same
    figure measured on all 496 real sessions."""
    real, mix = _measured()[name], mix_figures(SessionMix(session_rate=1.0))[name]
    assert _off(mix.mean, real.mean) <= MEAN_TOLERANCE, (name, mix, real)
    assert _off(mix.median, real.median) <= MEDIAN_TOLERANCE, (name, mix, real)
    assert _off(mix.p90, real.p90) <= P90_TOLERANCE, (name, mix, real)


def test_the_mix_draws_prompts_shaped_like_the_real_ones() -> None:
    """The prompts the simulator's sessions reach (first prompt, growth per turn, the end at
    `max_context`) against every real request's prompt."""
    real = _measured()["prompt"]
    drawn = Figure.of(simulated_prompts(SessionMix(session_rate=1.0), 20_000, seed=1))
    for k in ("mean", "median", "p90"):
        assert _off(getattr(drawn, k), getattr(real, k)) <= PROMPT_TOLERANCE, (k, drawn, real)
