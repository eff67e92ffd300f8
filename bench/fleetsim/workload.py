"""Workload generators for the fleet simulator: coding-agent sessions and JSONL trace replay.

Sessions (closed loop): a session starts (Poisson, rate from :class:`SessionMix` and its
modifiers), sends its first turn with a cold context, and after each answer waits a tool pause,
then sends the next turn whose context grew by the previous output plus the tool result. It ends
after its turn count or when the context would pass ``max_context``. Modifiers change one thing
over a time window: a session-start storm, longer tool pauses, an output-length shift, smaller
or larger tool results.

Trace replay (open loop): one JSON object per line with ``timestamp`` (seconds or ms),
``input_length``, ``output_length`` and ``hash_ids`` (prefix block ids, e.g. 512 tokens each);
requests whose first block id matches belong to one conversation, and the cached prefix of a
request is the common block prefix with that conversation's previous request.

Pure apart from :func:`read_trace`, which reads a file the caller names; numpy only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SessionMix:
    """Distribution of coding-agent sessions (lognormal sizes given by mean and sigma).

    The defaults are the 496 real Claude Code sessions' (../shared/traces; measured by
    `calibration.measure`, checked by tests/unit/test_calibration.py): each lognormal has the
    traces' mean and median (first prompt 95.9K / 24.9K tokens, new tokens per turn 1,227 /
    279, output 441 / 219, think time 177 / 10 s), turns are geometric with the traces' mean
    (67.5 requests per session), and a session ends once its context would pass 320K tokens,
    which gives the traces' prompt per request (mean 121K against 128K, median 106K, p90 247K
    against 249K). Their tails are lognormal's, not the traces': the 90th percentiles are
    within 30% (the first prompt's 203K against 271K, the think time's 217 s against 167 s)."""

    session_rate: float  # session starts per second
    mean_turns: float = 67.5
    first_input_tokens: float = 95_900.0
    first_input_sigma: float = 1.64
    new_tokens_per_turn: float = 1_230.0
    new_tokens_sigma: float = 1.72
    output_tokens: float = 440.0
    output_sigma: float = 1.18
    tool_pause_s: float = 177.0
    tool_pause_sigma: float = 2.40
    max_context: float = 320_000.0
    shared_prefix_tokens: float = 2_000.0

    def request_rate(self) -> float:
        """Steady-state requests per second (each session sends ``mean_turns`` requests)."""
        return self.session_rate * self.mean_turns


@dataclass(frozen=True)
class Modifier:
    """Multiply one parameter during [start_s, end_s): ``session_rate`` (storm),
    ``tool_pause_s`` (longer pauses), ``output_tokens`` (output-length shift) or
    ``new_tokens_per_turn`` (tool-result size, e.g. a reading -> writing shift). Each is read
    when it is drawn: session starts per step, outputs at arrival, pauses and new tokens when
    a turn finishes."""

    field: str
    factor: float
    start_s: float
    end_s: float = float("inf")


@dataclass(frozen=True)
class SessionWorkload:
    mix: SessionMix
    modifiers: tuple[Modifier, ...] = ()
    seed: int = 0

    def value(self, name: str, t: float) -> float:
        """Parameter ``name`` of the mix at time ``t`` after modifiers."""
        v = float(getattr(self.mix, name))
        for m in self.modifiers:
            if m.field == name and m.start_s <= t < m.end_s:
                v *= m.factor
        return v


def lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """``n`` lognormal samples with the given mean (not median) and log-sd ``sigma``."""
    mu = np.log(max(mean, 1e-9)) - sigma * sigma / 2.0
    return rng.lognormal(mu, sigma, n)


@dataclass(frozen=True)
class Turns:
    """Every turn of sessions drawn from a mix: per turn its session, its index in the session
    (0: the first), the context it sends, and its session's drawn turn count."""

    session: np.ndarray
    index: np.ndarray
    context: np.ndarray
    turns: np.ndarray


def draw_turns(
    mix: SessionMix,
    sessions: int,
    rng: np.random.Generator,
    output_tokens: float | None = None,
    new_tokens_per_turn: float | None = None,
) -> Turns:
    """``sessions`` sessions drawn as the simulator draws them: a first prompt (at most
    ``max_context``), each turn growing by its answer and new tokens, the session ending after
    its turn count or once its context would pass ``max_context``. Every turn of them, in
    order of turn index."""
    out = mix.output_tokens if output_tokens is None else output_tokens
    new = mix.new_tokens_per_turn if new_tokens_per_turn is None else new_tokens_per_turn
    ctx = np.minimum(
        lognormal(rng, mix.first_input_tokens, mix.first_input_sigma, sessions), mix.max_context
    )
    turns = rng.geometric(1.0 / max(mix.mean_turns, 1.0), sessions)
    ids = np.arange(sessions)
    live = np.ones(sessions, dtype=bool)
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    k = 0
    while live.any():
        rows.append((ids[live], np.full(int(live.sum()), k), ctx[live].copy()))
        k += 1
        n = int(live.sum())
        grow = lognormal(rng, out, mix.output_sigma, n) + lognormal(
            rng, new, mix.new_tokens_sigma, n
        )
        ctx[live] += grow
        live &= (turns > k) & (ctx <= mix.max_context)
    session = np.concatenate([r[0] for r in rows])
    return Turns(
        session,
        np.concatenate([r[1] for r in rows]),
        np.concatenate([r[2] for r in rows]),
        turns[session],
    )


@dataclass
class Trace:
    """Open-loop requests sorted by time; ``cached`` is the reusable prefix per request."""

    arrival: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    conversation: np.ndarray
    cached_prefix: np.ndarray
    block_tokens: int = 512
    meta: dict[str, float] = field(default_factory=dict)


def parse_trace(
    lines: Iterable[str], block_tokens: int = 512, timestamp_unit_s: float = 1e-3
) -> Trace:
    """Parse JSONL trace lines (see module doc); timestamps are in milliseconds by default
    (the Mooncake trace convention) and shifted to start at 0."""
    ts: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    conv: list[int] = []
    cached: list[int] = []
    last_blocks: dict[int, list[int]] = {}
    conv_ids: dict[int, int] = {}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        rec = json.loads(line)
        blocks = [int(h) for h in rec.get("hash_ids", [])]
        key = blocks[0] if blocks else -len(ts) - 1
        cid = conv_ids.setdefault(key, len(conv_ids))
        prev = last_blocks.get(cid, [])
        common = 0
        for a, b in zip(prev, blocks, strict=False):
            if a != b:
                break
            common += 1
        last_blocks[cid] = blocks
        n_in = int(rec["input_length"])
        ts.append(float(rec["timestamp"]))
        inp.append(n_in)
        out.append(max(1, int(rec["output_length"])))
        conv.append(cid)
        cached.append(min(common * block_tokens, max(n_in - 1, 0)))
    arr = np.asarray(ts, dtype=np.float64) * timestamp_unit_s
    if arr.size:
        arr = arr - arr.min()
    order = np.argsort(arr, kind="stable")
    return Trace(
        arrival=arr[order],
        input_tokens=np.asarray(inp, dtype=np.float64)[order],
        output_tokens=np.asarray(out, dtype=np.float64)[order],
        conversation=np.asarray(conv, dtype=np.int64)[order],
        cached_prefix=np.asarray(cached, dtype=np.float64)[order],
        block_tokens=block_tokens,
    )


def read_trace(path: str, block_tokens: int = 512, timestamp_unit_s: float = 1e-3) -> Trace:
    """Read a JSONL trace file (the only I/O in this package)."""
    with open(path, encoding="utf-8") as fh:
        return parse_trace(fh, block_tokens, timestamp_unit_s)


def synth_trace_lines(
    n: int, rate: float, seed: int = 0, conversations: int = 50, block_tokens: int = 512
) -> list[str]:
    """A small synthetic trace in the replay format (for tests and examples)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    ctx = np.zeros(conversations, dtype=np.int64)
    lines = []
    for i in range(n):
        c = int(rng.integers(conversations))
        ctx[c] += int(rng.integers(500, 4000))
        blocks = [c * 1_000_000 + b for b in range(int(ctx[c]) // block_tokens + 1)]
        lines.append(
            json.dumps(
                {
                    "timestamp": round(float(t[i]) * 1000.0, 3),
                    "input_length": int(ctx[c]),
                    "output_length": int(rng.integers(50, 800)),
                    "hash_ids": blocks,
                }
            )
        )
    return lines
