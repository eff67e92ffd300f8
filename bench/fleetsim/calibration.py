"""The figures `SessionMix`'s defaults are calibrated to, measured on real sessions (pure).

Data flow: Claude Code sessions (`bench.traces`, top-level sessions; their subagents are not
sessions the mix draws) -> `measure`: per figure the mean, median and 90th percentile ->
compared with `mix_figures(SessionMix(...))`, the same figures of the mix's own distributions
(lognormals given by mean and log-sd, a geometric turn count), by tests/unit/test_calibration.py.

The figures, as the simulator's sessions use them:

- ``first_input``: a session's first prompt (tokens);
- ``new_tokens``: what a turn adds besides the previous answer (tool results, the user's
  text): ``prompt - previous prompt - previous output`` over consecutive requests whose prompt
  extends the previous one (shares all its full blocks but the last), at least 0;
- ``output``: every request's output tokens;
- ``think``: the tool or human time before every request but a session's first (seconds);
- ``turns``: requests per session;
- ``prompt``: every request's prompt (tokens): what a session's growth and its end at
  ``max_context`` add up to (the traces' sessions compact or end; the mix ends them there).

Each lognormal of the mix is set from the measured mean and median (log-sd
``sqrt(2 ln(mean / median))``), so its 90th percentile is a check of its shape, not a fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from bench.traces import TraceSession

from .workload import SessionMix, draw_turns

Z90 = NormalDist().inv_cdf(0.9)


@dataclass(frozen=True)
class Figure:
    mean: float
    median: float
    p90: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Figure:
        x = np.asarray(list(values), dtype=float)
        return cls(float(x.mean()), float(np.median(x)), float(np.percentile(x, 90)))

    @classmethod
    def lognormal(cls, mean: float, sigma: float) -> Figure:
        median = mean * math.exp(-sigma * sigma / 2.0)
        return cls(mean, median, median * math.exp(Z90 * sigma))


def sigma_for(mean: float, median: float) -> float:
    """The log-sd of the lognormal with this mean and median."""
    return math.sqrt(2.0 * math.log(max(mean / median, 1.0)))


FIGURES = ("first_input", "new_tokens", "output", "think", "turns", "prompt")


def measure(sessions: Iterable[TraceSession]) -> dict[str, Figure]:
    """The figures of real sessions (module doc)."""
    rows: dict[str, list[float]] = {k: [] for k in FIGURES}
    for s in sessions:
        reqs = s.requests
        if not reqs:
            continue
        rows["first_input"].append(reqs[0].input_tokens)
        rows["turns"].append(len(reqs))
        for k, r in enumerate(reqs):
            rows["output"].append(r.output_tokens)
            rows["prompt"].append(r.input_tokens)
            if k == 0:
                continue
            prev = reqs[k - 1]
            rows["think"].append(r.think_s)
            if _extends(prev.block_ids, r.block_ids):
                rows["new_tokens"].append(
                    max(r.input_tokens - prev.input_tokens - prev.output_tokens, 0)
                )
    return {k: Figure.of(v) for k, v in rows.items()}


def _extends(prev: np.ndarray, ids: np.ndarray) -> bool:
    """Whether a prompt holds the previous one (all its full blocks but the last, which the
    previous answer may complete) as its prefix."""
    keep = max(len(prev) - 1, 0)
    return len(ids) >= keep and bool(np.array_equal(ids[:keep], prev[:keep]))


def mix_figures(mix: SessionMix) -> dict[str, Figure]:
    """The mix's own figures, from its distributions (turns: geometric with its mean; the
    prompt is left out: it is what the simulator makes of the rest)."""
    p = 1.0 / max(mix.mean_turns, 1.0)
    turns_median = math.ceil(math.log(0.5) / math.log(1.0 - p)) if p < 1.0 else 1.0
    turns_p90 = math.ceil(math.log(0.1) / math.log(1.0 - p)) if p < 1.0 else 1.0
    return {
        "first_input": Figure.lognormal(mix.first_input_tokens, mix.first_input_sigma),
        "new_tokens": Figure.lognormal(mix.new_tokens_per_turn, mix.new_tokens_sigma),
        "output": Figure.lognormal(mix.output_tokens, mix.output_sigma),
        "think": Figure.lognormal(mix.tool_pause_s, mix.tool_pause_sigma),
        "turns": Figure(mix.mean_turns, float(turns_median), float(turns_p90)),
    }


def simulated_prompts(mix: SessionMix, sessions: int, seed: int) -> np.ndarray:
    """Every prompt of ``sessions`` sessions drawn as the simulator draws them
    (`workload.draw_turns`)."""
    return draw_turns(mix, sessions, np.random.default_rng(seed)).context
