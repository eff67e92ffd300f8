"""Evidence of degenerate repetition in a request's own output tokens (pure).

A high speculative accept rate alone does not mean repetition: a coding agent copying a file
verbatim, or writing boilerplate the draft model predicts, accepts nearly every draft too.
Degenerate repetition has a second signature the copy lacks: its tokens repeat with a short
period. `short_period` looks for it in the last `window` tokens: the smallest period p
(1..max_period) for which at least `min_match` of those tokens equal the token p before them.
A verbatim copy of source code repeats lines now and then, not every few tokens over a whole
window, so it has none (docs/engine.md, "The repetition rule", has the calibration).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_WINDOW = 96
DEFAULT_MAX_PERIOD = 48
DEFAULT_MIN_MATCH = 0.95


def short_period(
    tokens: Sequence[int],
    *,
    window: int = DEFAULT_WINDOW,
    max_period: int = DEFAULT_MAX_PERIOD,
    min_match: float = DEFAULT_MIN_MATCH,
) -> int | None:
    """The smallest period the last `window` tokens repeat with, or None (also when fewer
    than `window + max_period` tokens exist: too few to tell)."""
    if window <= 0 or max_period <= 0 or len(tokens) < window + max_period:
        return None
    tail = np.asarray(tokens[len(tokens) - window - max_period :], dtype=np.int64)
    recent = tail[max_period:]
    for period in range(1, max_period + 1):
        before = tail[max_period - period : max_period - period + window]
        if np.count_nonzero(recent == before) >= min_match * window:
            return period
    return None
