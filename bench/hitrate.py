"""Hit-rate model against an exact LRU replay of real sessions (issue 39, part 2).

Usage: python -m bench.hitrate --sessions DIR --out FILE [--figure PNG] [--limit N] [--live
25,50,...] [--capacities-m 1,2,...] [--think-scales 1,0.25] [--seeds 1,2,3] (DIR: a folder of
Claude Code session files or their tarball, e.g. ../shared/traces/claude-code-sessions.tar.gz;
`make bench-hitrate` runs the full grid and draws docs/results/hitrate.png).

Data flow: `bench.traces.read_claude_sessions` streams the sessions -> `compact` keeps per
session, for each think-time scale, only what the replay needs (request times, prompt
tokens, first-turn flags and, per request, its "groups": runs of prefix blocks last referenced
by the same earlier request of the session) -> per overlay (live sessions x think scale x
seed): Poisson session starts at the rate that keeps that many sessions live (Little's law),
sessions placed in a seeded random order (`bench.traces.overlay`) -> `replay`: one pass over
the requests in time order with a Fenwick tree over requests gives every group's LRU stack
position (Mattson), hence the hit rate at every capacity at once -> `measure`: what the
engines would export from the same traffic (the token-weighted reuse-time histogram of
sampled prompt blocks with a bounded ghost, first-seen tokens, requests, returning-request
prompt tokens) and what the operator measures today (request rate, mean input and output,
first-turn share, mean cycle) -> the new model (`cas_operator.autoscale.reuse`) and the old
one (`model.hit_probabilities` without a profile) -> JSON rows per cell, a table, a figure.

Definitions (the same on both sides):
- the cache: one pooled LRU of ``capacity / 64`` blocks of 64 tokens keyed by (session
  scope, block id); a request hits the longest prefix of its blocks present when it arrives,
  then all its blocks become most recently used, deeper blocks less recent than their
  ancestors (a radix tree's leaf-first eviction); the prompt's fresh tail is never cached;
- the returning-turn hit rate: cached prompt tokens over prompt tokens (tail included) of
  every request that is not its session's first, arriving inside the measured window;
- the measured window: ``[0, H)`` with ``H`` long enough for each trace session to start about
  once; sessions start from ``-W`` (``W`` the 90th percentile session duration) so the
  cache and the live sessions are in steady state when it opens.

Nothing is fitted to sessions: the model reads only the measured histogram and counters.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.traces import (
    TraceSession,
    placement_order,
    poisson_starts,
    read_claude_sessions,
    think_scaled,
)
from cas_engine.prefixreuse import DEFAULT_GHOST_ENTRIES, DEFAULT_SAMPLE_RATE, REUSE_BUCKETS_S
from cas_operator.autoscale.model import WorkloadInputs, hit_probabilities
from cas_operator.autoscale.reuse import (
    ReuseProfile,
    profile_from_counts,
    quantized_profile,
    returning_hit_rate,
)

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

LIVE_SESSIONS = (25, 50, 100, 200)
CAPACITIES = tuple(m * 1_000_000 for m in (1, 2, 4, 8, 16, 32, 64))
THINK_SCALES = (1.0, 0.25)
SEEDS = (1, 2, 3)
BLOCK_SIZE = 64  # the Claude Code traces' blocks, and the engines' tracked block
# What the engines would export is emulated with their defaults: 1 in DEFAULT_SAMPLE_RATE blocks
# tracked, a ghost of DEFAULT_GHOST_ENTRIES tracked blocks, the same histogram bounds.
SAMPLE_RATE = DEFAULT_SAMPLE_RATE
GHOST_ENTRIES = DEFAULT_GHOST_ENTRIES


# ---------------------------------------------------------------- compaction


@dataclass(frozen=True)
class Compact:
    """One top-level session (subagents merged in) for one think scale: requests in time
    order, and per request its groups (a run of prefix blocks whose last reference was the
    same earlier request of the session, or none: first seen)."""

    times: F64  # request arrival, seconds on the session's clock
    prompt: I64  # input tokens
    output: I64  # output tokens
    returning: npt.NDArray[np.bool_]  # not its (sub)session's first request
    blocks: I64  # full blocks of the prompt
    group_request: I64  # request index of each group (groups ordered by request, then depth)
    group_prev: I64  # the earlier request that last referenced the group's blocks, or -1
    group_depth: I64  # depth of the group's first block
    group_size: I64  # blocks
    group_sampled: I64  # of them, blocks the engines' spatial sampling tracks
    duration_s: float


def _sampled(ids: I64, scope: str, rate: int) -> npt.NDArray[np.bool_]:
    """The engines' spatial sampling emulated: a block is tracked when a hash of its key falls
    in 1/rate of the hash space (the same blocks every time they are referenced)."""
    if rate <= 1:
        return np.ones(len(ids), dtype=bool)
    salt = np.uint64(zlib.crc32(scope.encode()))
    with np.errstate(over="ignore"):
        h = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + salt
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
    return np.asarray(h % np.uint64(rate) == 0)


def compact(session: TraceSession, think_scale: float, sample_rate: int = SAMPLE_RATE) -> Compact:
    """`session` with think times scaled, reduced to what `replay` and `measure` read."""
    scaled = think_scaled(session, think_scale)
    placed = sorted(
        (
            (offset + r.t, order, turn > 0, r)
            for order, (offset, member) in enumerate(scaled.family())
            for turn, r in enumerate(member.requests)
        ),
        key=lambda x: (x[0], x[1]),
    )
    n = len(placed)
    blocks = np.array([len(p[3].block_ids) for p in placed], dtype=np.int64)
    ids = np.concatenate([p[3].block_ids for p in placed]) if n else np.zeros(0, np.int64)
    req = np.repeat(np.arange(n, dtype=np.int64), blocks)
    depth = np.arange(len(ids), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    prev = np.full(len(ids), -1, dtype=np.int64)
    if len(ids):
        order = np.lexsort((req, ids))
        same = ids[order][1:] == ids[order][:-1]
        prev[order[1:][same]] = req[order][:-1][same]
    start = np.ones(len(ids), dtype=bool)
    if len(ids):
        start[1:] = (req[1:] != req[:-1]) | (prev[1:] != prev[:-1])
    cut = np.flatnonzero(start)
    sizes = np.diff(np.append(cut, len(ids)))
    tracked = _sampled(ids, session.root, sample_rate).astype(np.int64)
    sampled = np.add.reduceat(tracked, cut) if len(cut) else np.zeros(0, np.int64)
    return Compact(
        times=np.array([p[0] for p in placed], dtype=float),
        prompt=np.array([p[3].input_tokens for p in placed], dtype=np.int64),
        output=np.array([p[3].output_tokens for p in placed], dtype=np.int64),
        returning=np.array([p[2] for p in placed], dtype=bool),
        blocks=blocks,
        group_request=req[cut],
        group_prev=prev[cut],
        group_depth=depth[cut],
        group_size=sizes.astype(np.int64),
        group_sampled=sampled.astype(np.int64),
        duration_s=scaled.family_duration_s,
    )


# ---------------------------------------------------------------- overlay and replay


@dataclass(frozen=True)
class Overlay:
    """All requests of one overlay in time order, with their groups on global request
    indices, and each group's LRU stack position when its request arrived."""

    times: F64
    prompt: I64
    blocks: I64
    returning: npt.NDArray[np.bool_]
    outputs: I64
    cycle_gap: F64  # per returning request: time since its session's previous request
    group_request: I64
    group_prev: I64
    group_size: I64
    group_sampled: I64
    position: I64  # blocks in front of the group's first block in LRU order (stack_positions)
    window_s: float
    rate: float  # session starts per second


def _place(
    sessions: Sequence[Compact], live: int, seed: int
) -> tuple[list[tuple[float, int]], float, float]:
    """Session placements (start, session index) for `live` sessions: Poisson starts at the
    Little's-law rate over [-W, H) (W: 90th percentile duration; H: time for each session to
    start about once)."""
    durations = np.array([s.duration_s for s in sessions])
    rate = live / float(durations.mean())
    warm = float(np.percentile(durations, 90))
    horizon = len(sessions) / rate
    starts = poisson_starts(rate, warm + horizon, seed, start_s=-warm)
    order = placement_order(len(sessions), len(starts), seed)
    return list(zip(starts.tolist(), order, strict=False)), horizon, rate


def overlay(sessions: Sequence[Compact], live: int, seed: int) -> Overlay:
    """Place sessions (see `_place`), merge them into one request order and replay the LRU."""
    placements, horizon, rate = _place(sessions, live, seed)
    parts = []
    base = 0
    for start, index in placements:
        s = sessions[index]
        times = start + s.times
        keep = times < horizon  # nothing after the window is measured or needed
        n = int(keep.sum())
        if n == 0:
            continue
        g = s.group_request < n
        gaps = np.diff(s.times, prepend=s.times[:1])
        parts.append(
            (
                times[:n], s.prompt[:n], s.returning[:n], s.output[:n], gaps[:n],
                s.blocks[:n], s.group_request[g] + base,
                np.where(s.group_prev[g] >= 0, s.group_prev[g] + base, -1),
                s.group_depth[g], s.group_size[g], s.group_sampled[g],
            )
        )  # fmt: skip
        base += n
    cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
    times, prompt, returning, outs, gaps, blocks, g_req, g_prev, g_depth, g_size, g_samp = cols
    order = np.argsort(times, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    g_req, g_prev = rank[g_req], np.where(g_prev >= 0, rank[np.maximum(g_prev, 0)], -1)
    g_order = np.lexsort((g_depth, g_req))
    g_req, g_prev, g_depth, g_size, g_samp = (
        a[g_order] for a in (g_req, g_prev, g_depth, g_size, g_samp)
    )
    position = stack_positions(blocks[order], g_req, g_prev, g_size)
    return Overlay(
        times=times[order],
        prompt=prompt[order],
        blocks=blocks[order],
        returning=returning[order],
        outputs=outs[order],
        cycle_gap=gaps[order],
        group_request=g_req,
        group_prev=g_prev,
        group_size=g_size,
        group_sampled=g_samp,
        position=position,
        window_s=horizon,
        rate=rate,
    )


def stack_positions(blocks: I64, g_req: I64, g_prev: I64, g_size: I64) -> I64:
    """Per group, the blocks in front of its first block in LRU order when its request
    arrives: ``W(p, i)``, the blocks whose last reference lies strictly between the group's
    last reference ``p`` and its request ``i`` (a Fenwick tree over requests holds, per
    request, the blocks it referenced last). The group's ``j``-th block has ``W + j`` in front
    (its ancestors of the same group were referenced after it in ``p``: leaf-first), so with a
    capacity of ``C`` blocks ``clip(C - W, 0, size)`` of them hit. First-seen groups get -1."""
    n = len(blocks)
    tree = [0] * (n + 1)
    out = np.full(len(g_req), -1, dtype=np.int64)
    req, prev, size, nblocks = g_req.tolist(), g_prev.tolist(), g_size.tolist(), blocks.tolist()
    g, total_groups = 0, len(req)
    for i in range(n):
        first = g
        while g < total_groups and req[g] == i:
            g += 1
        before_i = _prefix(tree, i)
        for k in range(first, g):
            if prev[k] >= 0:
                out[k] = before_i - _prefix(tree, prev[k] + 1)
        for k in range(first, g):
            if prev[k] >= 0:
                _add(tree, prev[k], -size[k])
        _add(tree, i, nblocks[i])
    return out


def _prefix(tree: list[int], i: int) -> int:
    """Sum of the weights of requests [0, i)."""
    total = 0
    while i > 0:
        total += tree[i]
        i -= i & -i
    return total


def _add(tree: list[int], i: int, value: int) -> None:
    i += 1
    n = len(tree)
    while i < n:
        tree[i] += value
        i += i & -i


# ---------------------------------------------------------------- both sides of one overlay


def replay_hits(o: Overlay, capacities: Sequence[float]) -> F64:
    """The exact LRU's returning-turn hit rate in the window at each capacity (tokens)."""
    in_window = o.times >= 0.0
    measured = in_window & o.returning
    g = measured[o.group_request] & (o.position >= 0)
    front, size = o.position[g].astype(float), o.group_size[g].astype(float)
    order = np.argsort(front)
    front, size = front[order], size[order]
    ends = np.sort(front + size)
    front_sum = np.concatenate([[0.0], np.cumsum(front)])
    end_sum = np.concatenate([[0.0], np.cumsum(ends)])
    c = np.floor(np.asarray(capacities, dtype=float) / BLOCK_SIZE)
    k = np.searchsorted(front, c, side="left")  # groups with front < c
    m = np.searchsorted(ends, c, side="left")
    hits = (c * k - front_sum[k]) - (c * m - end_sum[m])
    return np.asarray(hits * BLOCK_SIZE / float(o.prompt[measured].sum()), dtype=float)


@dataclass(frozen=True)
class Measured:
    """What the fleet's engines and the operator would measure over the overlay's window."""

    profile: ReuseProfile
    request_rate: float
    avg_input_tokens: float
    avg_output_tokens: float
    first_turn_fraction: float
    cycle_s: float  # mean time between consecutive requests of a session


def measure(
    o: Overlay,
    sample_rate: int = SAMPLE_RATE,
    ghost_entries: int = GHOST_ENTRIES,
    bounds: Sequence[float] = REUSE_BUCKETS_S,
) -> Measured:
    """The engines' export emulated on the window: per group of sampled blocks, its reuse
    time (request time minus its last reference's) into the token-weighted histogram, or
    first-seen when never referenced or when it fell out of the ghost (more than
    ``ghost_entries * sample_rate`` blocks in front); requests; and prompt tokens of requests
    with a tracked block seen before. And the operator's request-level figures."""
    in_window = o.times >= 0.0
    g_in = in_window[o.group_request]
    tracked = o.group_sampled[g_in] if sample_rate > 1 else o.group_size[g_in]
    tokens = tracked * max(sample_rate, 1) * BLOCK_SIZE
    seen = (o.position[g_in] >= 0) & (o.position[g_in] < ghost_entries * max(sample_rate, 1))
    prev = np.maximum(o.group_prev[g_in], 0)
    reuse = o.times[o.group_request[g_in]] - o.times[prev]
    edges = [*bounds, math.inf]
    per_bucket = np.histogram(
        reuse[seen], bins=[-math.inf, *bounds, math.inf], weights=tokens[seen]
    )[0]
    cumulative = np.cumsum(per_bucket)
    seen_requests = np.zeros(len(o.times), dtype=bool)
    seen_requests[o.group_request[g_in][seen & (tracked > 0)]] = True
    sizes = o.blocks[in_window].astype(float) * BLOCK_SIZE
    profile = profile_from_counts(
        list(zip(edges, cumulative.tolist(), strict=True)),
        first_seen_tokens=float(tokens[~seen].sum()),
        requests=float(in_window.sum()),
        request_tokens=float(sizes.sum()),
        request_token_squares=float((sizes**2).sum()),
        returning_prompt_tokens=float(o.prompt[seen_requests & in_window].sum()),
    )
    if profile is None:
        raise ValueError("no prompt block referenced in the window")
    n = float(in_window.sum())
    ret = in_window & o.returning
    return Measured(
        profile=quantized_profile(profile),  # as the operator's planner sees it
        request_rate=n / o.window_s,
        avg_input_tokens=float(o.prompt[in_window].mean()),
        avg_output_tokens=float(o.outputs[in_window].mean()),
        first_turn_fraction=float((in_window & ~o.returning).sum()) / n,
        cycle_s=float(o.cycle_gap[ret].mean()) if ret.any() else 0.0,
    )


def model_hits(m: Measured, capacities: Sequence[float]) -> list[float]:
    """The new model's returning-turn hit rate at each pooled capacity."""
    out = []
    for c in capacities:
        hit = returning_hit_rate(m.profile, c, m.request_rate)
        out.append(0.0 if hit is None else hit)
    return out


def old_model_hits(m: Measured, capacities: Sequence[float]) -> list[float]:
    """The previous model (Che's approximation, exponential gaps) fed with what the operator
    measures, scaled to the returning turns' seen share like the new one."""
    wl = WorkloadInputs(
        request_rate=m.request_rate,
        avg_input_tokens=m.avg_input_tokens,
        avg_output_tokens=m.avg_output_tokens,
        first_turn_fraction=m.first_turn_fraction,
    )
    seen = m.profile.seen_share / (m.profile.returning_share or 1.0)
    return [hit_probabilities(wl, c, 0.0, m.cycle_s)[0] * seen for c in capacities]


# ---------------------------------------------------------------- the grid


CROSSING_LEVELS = (0.5, 0.9)
FINE_CAPACITIES = tuple(1_000_000 * 2 ** (k / 4) for k in range(-12, 29))  # 0.125M .. 128M


@dataclass(frozen=True)
class Grid:
    """What `run` sweeps: live sessions x think scales x seeds, the capacities of the table,
    and the finer capacities the curves and the 50%/90% crossings are read on."""

    live: tuple[int, ...] = LIVE_SESSIONS
    capacities: tuple[float, ...] = CAPACITIES
    think_scales: tuple[float, ...] = THINK_SCALES
    seeds: tuple[int, ...] = SEEDS
    fine: tuple[float, ...] = FINE_CAPACITIES


def load(
    path: str | Path,
    think_scales: Iterable[float] = THINK_SCALES,
    limit: int | None = None,
    sample_rate: int = SAMPLE_RATE,
) -> dict[float, list[Compact]]:
    """Every session at `path` (the first `limit`), compacted once per think scale; each
    session's JSON is dropped once compacted."""
    scales = tuple(think_scales)
    out: dict[float, list[Compact]] = {s: [] for s in scales}
    for n, session in enumerate(read_claude_sessions(path)):
        if limit is not None and n >= limit:
            break
        for scale in scales:
            out[scale].append(compact(session, scale, sample_rate))
    return out


def crossing(capacities: Sequence[float], curve: Sequence[float], level: float) -> float | None:
    """The capacity at which `curve` first reaches `level` (log-linear between points); None
    when it never does, the first capacity when it starts above."""
    for k, value in enumerate(curve):
        if value >= level:
            if k == 0:
                return float(capacities[0])
            lo, hi = math.log(capacities[k - 1]), math.log(capacities[k])
            share = (level - curve[k - 1]) / (value - curve[k - 1])
            return float(math.exp(lo + share * (hi - lo)))
    return None


def run(
    compacts: dict[float, list[Compact]],
    grid: Grid = Grid(),
    sample_rate: int = SAMPLE_RATE,
    ghost_entries: int = GHOST_ENTRIES,
) -> dict[str, Any]:
    """Every overlay of the grid: the replay and both models at every capacity, averaged over
    the seeds; rows for the table capacities, curves on the fine ones, and the summary."""
    rows, curves = [], []
    caps = list(grid.capacities) + list(grid.fine)
    for scale in grid.think_scales:
        for live in grid.live:
            per_seed = []
            for seed in grid.seeds:
                o = overlay(compacts[scale], live, seed)
                m = measure(o, sample_rate, ghost_entries)
                per_seed.append(
                    (
                        replay_hits(o, caps),
                        np.array(model_hits(m, caps)),
                        np.array(old_model_hits(m, caps)),
                    )
                )
            lru, new, old = (np.mean([s[k] for s in per_seed], axis=0) for k in range(3))
            n = len(grid.capacities)
            for k, cap in enumerate(grid.capacities):
                rows.append(
                    {
                        "live_sessions": live,
                        "capacity_tokens": int(cap),
                        "think_scale": scale,
                        "lru_returning_hit": round(float(lru[k]), 4),
                        "model_returning_hit": round(float(new[k]), 4),
                        "old_model_returning_hit": round(float(old[k]), 4),
                    }
                )
            curves.append(
                {
                    "live_sessions": live,
                    "think_scale": scale,
                    "capacity_tokens": [int(c) for c in grid.fine],
                    "lru": [round(float(v), 4) for v in lru[n:]],
                    "model": [round(float(v), 4) for v in new[n:]],
                    "old_model": [round(float(v), 4) for v in old[n:]],
                }
            )
    return {"rows": rows, "curves": curves, "summary": summarize(rows, curves)}


def summarize(rows: Sequence[dict[str, Any]], curves: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and worst absolute error over the table's cells, and per (think scale, live
    sessions) the capacity at which each curve reaches 50% and 90% and its ratio to the
    replay's, for the new and the old model."""
    out: dict[str, object] = {}
    for name in ("model", "old_model"):
        errors = [abs(r[f"{name}_returning_hit"] - r["lru_returning_hit"]) for r in rows]
        worst = max(range(len(rows)), key=lambda k: errors[k])
        cell = {k: rows[worst][k] for k in ("live_sessions", "capacity_tokens", "think_scale")}
        out[name] = {
            "mean_abs_error": round(float(np.mean(errors)), 4),
            "worst_abs_error": round(errors[worst], 4),
            "worst_cell": cell,
        }
    crossings = []
    for c in curves:
        for level in CROSSING_LEVELS:
            replay = crossing(c["capacity_tokens"], c["lru"], level)
            entry: dict[str, object] = {
                "live_sessions": c["live_sessions"],
                "think_scale": c["think_scale"],
                "level": level,
                "lru_capacity_tokens": replay,
            }
            for name in ("model", "old_model"):
                found = crossing(c["capacity_tokens"], c[name], level)
                entry[f"{name}_capacity_tokens"] = found
                entry[f"{name}_ratio"] = (
                    round(found / replay, 3) if found is not None and replay else None
                )
            crossings.append(entry)
    out["crossings"] = crossings
    for name in ("model", "old_model"):
        ratios = [e[f"{name}_ratio"] for e in crossings if e[f"{name}_ratio"] is not None]
        out[f"{name}_capacity_ratio_range"] = (
            [min(ratios), max(ratios)] if ratios else None  # type: ignore[type-var]
        )
    return out


# ---------------------------------------------------------------- report


def _m(tokens: float | None) -> str:
    return "-" if tokens is None else f"{tokens / 1e6:.2f}M"


def table(result: dict[str, Any]) -> str:
    """One line per (think scale, live sessions): the capacity the replay needs for 50% and
    90% returning-turn hits and each model's ratio to it, and each model's worst error."""
    summary = result["summary"]
    lines = [
        "think  live | replay 50%  new   old | replay 90%  new   old | worst err new   old",
    ]
    crossings = {
        (e["think_scale"], e["live_sessions"], e["level"]): e for e in summary["crossings"]
    }
    for c in result["curves"]:
        key = (c["think_scale"], c["live_sessions"])
        cells = [r for r in result["rows"] if (r["think_scale"], r["live_sessions"]) == key]
        err_new = max(abs(r["model_returning_hit"] - r["lru_returning_hit"]) for r in cells)
        err_old = max(abs(r["old_model_returning_hit"] - r["lru_returning_hit"]) for r in cells)
        parts = [f"x{key[0]:<4} {key[1]:>5} |"]
        for level in CROSSING_LEVELS:
            e = crossings[(*key, level)]
            ratio_new = e["model_ratio"]
            ratio_old = e["old_model_ratio"]
            parts.append(
                f" {_m(e['lru_capacity_tokens']):>9} "
                f"{'-' if ratio_new is None else f'{ratio_new:.2f}':>5} "
                f"{'-' if ratio_old is None else f'{ratio_old:.2f}':>5} |"
            )
        parts.append(f"         {err_new:.3f} {err_old:.3f}")
        lines.append("".join(parts))
    for name, label in (("model", "new"), ("old_model", "old")):
        s = summary[name]
        lines.append(
            f"{label}: mean abs error {s['mean_abs_error']:.3f}, worst {s['worst_abs_error']:.3f} "
            f"at {s['worst_cell']}; capacity ratio range {summary[f'{name}_capacity_ratio_range']}"
        )
    return "\n".join(lines)


def figure(result: dict[str, Any], path: str | Path) -> None:
    """Returning-turn hit rate against pooled capacity, one colour per live-session count: the
    replay (solid), the new model (dashed), the old one (dotted); a panel per think scale."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({c["think_scale"] for c in result["curves"]}, reverse=True)
    fig, axes = plt.subplots(1, len(scales), figsize=(6 * len(scales), 4.5), sharey=True)
    axes = np.atleast_1d(axes)
    colours = plt.get_cmap("viridis")
    lives = sorted({c["live_sessions"] for c in result["curves"]})
    for ax, scale in zip(axes, scales, strict=True):
        for c in (c for c in result["curves"] if c["think_scale"] == scale):
            colour = colours(lives.index(c["live_sessions"]) / max(len(lives) - 1, 1))
            x = np.array(c["capacity_tokens"]) / 1e6
            ax.plot(x, c["lru"], "-", color=colour, label=f"{c['live_sessions']} live: LRU replay")
            ax.plot(x, c["model"], "--", color=colour, label="  new model")
            ax.plot(x, c["old_model"], ":", color=colour, label="  old model")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("pooled prefix cache (M tokens)")
        ax.set_title(f"think times x{scale:g}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("returning-turn hit rate")
    axes[-1].legend(fontsize=7, loc="lower right", ncol=1)
    fig.suptitle("Claude Code sessions: exact LRU replay vs hit-rate models (3 seeds, means)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hitrate", description=__doc__)
    parser.add_argument("--sessions", required=True, help="folder or tarball of session files")
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--figure", help="PNG of the curves (needs matplotlib)")
    parser.add_argument("--limit", type=int, help="read only the first N sessions")
    parser.add_argument("--live", default=",".join(map(str, LIVE_SESSIONS)))
    parser.add_argument("--capacities-m", default=",".join(str(c // 10**6) for c in CAPACITIES))
    parser.add_argument("--think-scales", default=",".join(map(str, THINK_SCALES)))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--sample-rate", type=int, default=SAMPLE_RATE)
    parser.add_argument("--ghost-entries", type=int, default=GHOST_ENTRIES)
    args = parser.parse_args(argv)
    grid = Grid(
        live=tuple(int(x) for x in _floats(args.live)),
        capacities=tuple(x * 1e6 for x in _floats(args.capacities_m)),
        think_scales=_floats(args.think_scales),
        seeds=tuple(int(x) for x in _floats(args.seeds)),
    )
    started = time.monotonic()
    compacts = load(args.sessions, grid.think_scales, args.limit, args.sample_rate)
    loaded = time.monotonic() - started
    result = run(compacts, grid, args.sample_rate, args.ghost_entries)
    result["setup"] = {
        "sessions": Path(args.sessions).name,
        "session_count": len(next(iter(compacts.values()))),
        "grid": asdict(grid) | {"fine": None},
        "sample_rate": args.sample_rate,
        "ghost_entries": args.ghost_entries,
        "block_size": BLOCK_SIZE,
        "reuse_buckets_s": list(REUSE_BUCKETS_S),
        "seconds": {"load": round(loaded, 1), "total": round(time.monotonic() - started, 1)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if args.figure:
        figure(result, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
