"""Block keys of a prompt and the sampled ghost map of their last references (module doc of
`cas_engine.prefixreuse`). Pure apart from the clock the caller gives; numpy for the keys."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from cas_engine.prefixreuse.metrics import ReuseMetrics

DEFAULT_BLOCK_SIZE = 64
DEFAULT_SAMPLE_RATE = 16  # 1 in 16 blocks tracked
# 2^18 tracked blocks (~30 MB of Python dict): 2^18 * 16 * 64 tokens = 268M tokens of distinct
# prompt blocks, far past any pool's KV cache, so reuses the cache could still hit are kept.
DEFAULT_GHOST_ENTRIES = 1 << 18

Keys = npt.NDArray[np.uint64]

_MODULUS = 1 << 64
_BASE = 0x100000001B3  # odd, so invertible modulo 2^64
_BASE_INV = pow(_BASE, -1, _MODULUS)
_TOKEN_WEIGHTS = np.random.default_rng(0x5EED5EED).integers(
    1, 2**63, size=4096, dtype=np.uint64
) | np.uint64(1)


def _mix(h: Keys) -> Keys:
    """splitmix64's finaliser: every key bit depends on every input bit."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


_POWER_TABLES: dict[int, Keys] = {}


def _powers(base: int, n: int) -> Keys:
    """``base^0 .. base^(n-1)`` modulo 2^64, from a table grown by doubling (computed once)."""
    table = _POWER_TABLES.get(base)
    if table is None or len(table) < n:
        size = max(n, 2 * (len(table) if table is not None else 1024))
        table = np.empty(size, dtype=np.uint64)
        value = 1
        for i in range(size):
            table[i] = value
            value = value * base % _MODULUS
        _POWER_TABLES[base] = table
    return table[:n]


def block_keys(tokens: Sequence[int] | npt.NDArray[Any], block_size: int) -> Keys:
    """One 64-bit key per full block of `tokens`, a hash of every token up to the block's end:
    ``key_k = mix(sum_{j<=k} h_j * B^(k-j))`` with ``h_j`` a hash of block ``j`` (vectorised as
    ``B^k * cumsum(h_j * B^-j)`` modulo 2^64)."""
    if block_size <= 0 or block_size > len(_TOKEN_WEIGHTS):
        raise ValueError(f"block_size must be in 1..{len(_TOKEN_WEIGHTS)}")
    ids = np.asarray(tokens, dtype=np.int64)
    n = len(ids) // block_size
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        blocks = ids[: n * block_size].reshape(n, block_size).astype(np.uint64)
        h = _mix((blocks * _TOKEN_WEIGHTS[:block_size]).sum(axis=1, dtype=np.uint64))
        prefix = np.cumsum(h * _powers(_BASE_INV, n), dtype=np.uint64)
        return _mix(prefix * _powers(_BASE, n))


@dataclass(frozen=True)
class RequestReuse:
    """One request's measurement: reuse times (s) of its tracked blocks seen before, each
    standing for `block_tokens` tokens; tokens of tracked blocks seen for the first time; its
    full-block tokens and prompt tokens; whether it reused a tracked block."""

    reuse_s: tuple[float, ...]
    block_tokens: int
    first_seen_tokens: int
    request_tokens: int
    prompt_tokens: int

    @property
    def returning(self) -> bool:
        return bool(self.reuse_s)


@dataclass
class ReuseTracker:
    """The ghost map of one engine (one per process that records; not thread-safe)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    sample_rate: int = DEFAULT_SAMPLE_RATE
    ghost_entries: int = DEFAULT_GHOST_ENTRIES
    metrics: ReuseMetrics | None = None
    clock: Callable[[], float] = time.monotonic
    _ghost: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.sample_rate < 1 or self.ghost_entries < 1:
            raise ValueError("sample_rate and ghost_entries must be >= 1")

    def __len__(self) -> int:
        return len(self._ghost)

    def observe(self, tokens: Sequence[int] | npt.NDArray[Any]) -> RequestReuse:
        """Record one arriving request's prompt; returns (and exports) what it measured."""
        now = self.clock()
        keys = block_keys(tokens, self.block_size)
        tracked = keys[keys % np.uint64(self.sample_rate) == 0].tolist()
        reuse: list[float] = []
        first = 0
        ghost = self._ghost
        for key in tracked:
            last = ghost.get(key)
            if last is None:
                first += 1
            else:
                reuse.append(max(now - last, 0.0))
                ghost.move_to_end(key)
            ghost[key] = now
        while len(ghost) > self.ghost_entries:
            ghost.popitem(last=False)
        weight = self.sample_rate * self.block_size
        result = RequestReuse(
            reuse_s=tuple(reuse),
            block_tokens=weight,
            first_seen_tokens=first * weight,
            request_tokens=len(keys) * self.block_size,
            prompt_tokens=len(tokens),
        )
        if self.metrics is not None:
            self.metrics.record(result)
        return result
