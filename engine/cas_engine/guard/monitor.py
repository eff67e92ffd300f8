"""Vectorised per-request monitor of speculative-decoding verify steps.

Data flow: the serving loop owns the requests and a slot index per running request (SGLang's
``req_pool_idx``, or :meth:`GuardMonitor.allocate` in the sim engine). After every verify step
of a batch it calls :meth:`GuardMonitor.observe` once with three equal-length arrays: slots,
accepted draft tokens and proposed draft tokens per request. The monitor owns numpy arrays
indexed by slot (running sums and a ring buffer of the last ``window`` speculative steps), so a
step costs a fixed number of numpy operations whatever the batch size. It returns the requests
that tripped in this step; the caller aborts them (see :mod:`cas_engine.guard.outcome`) and
calls :meth:`GuardMonitor.finish` when any request ends, which feeds the histograms.

Statistics (per request, over the request so far and over the last ``window`` speculative steps):

- accept length = mean over speculative steps of (accepted + 1): tokens per verify step, the
  bonus token included, as SGLang's ``spec_accept_length`` (SGLang divides completion tokens by
  verify steps, which also counts the prefill's first token; the difference is 1/steps).
- accept rate = accepted / proposed drafts (SGLang's ``spec_accept_rate``).

Rules: a request is judged only once it has generated MORE than ``min_generated_tokens``
tokens (each step adds accepted + 1) and has at least one speculative step; the windowed check
applies only once the window is full. Trip when accept length < ``min_accept_length``
(``low_accept_length``, checked first) or accept rate > ``max_accept_rate``
(``high_accept_rate``), strict inequalities. When the caller passes ``tokens`` (a request's
output token ids by slot) and ``repetition_period`` > 0, a high accept rate trips only when
those tokens also repeat with a short period (:func:`cas_engine.guard.repetition.short_period`);
otherwise the request is kept and counted once in ``cas_guard_high_accept_kept_total``. Steps
with NaN, negative values or accepted > proposed are ignored and counted; a step with zero
proposed drafts adds one generated token but no speculative statistics. A tripped request is not
judged again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cas_engine.guard.config import GuardConfig
from cas_engine.guard.metrics import GuardMetrics
from cas_engine.guard.outcome import GuardTrip, Reason, Scope
from cas_engine.guard.repetition import DEFAULT_WINDOW as REPETITION_WINDOW
from cas_engine.guard.repetition import short_period

logger = logging.getLogger("cas_engine.guard")

ArrayLike = npt.ArrayLike
TokensOf = Callable[[int], Sequence[int]]  # slot -> the request's output token ids


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Statistics of one slot at a point in time (NaN where undefined)."""

    request_id: str | None
    generated_tokens: int
    verify_steps: int
    accepted: int
    proposed: int
    accept_length: float
    accept_rate: float
    checked: bool
    tripped: bool


class GuardMonitor:
    """Per-slot accept statistics for up to ``capacity`` concurrent requests.

    Not thread-safe: one scheduler thread calls it (SGLang runs one scheduler loop per rank).
    """

    def __init__(
        self,
        config: GuardConfig,
        capacity: int,
        *,
        metrics: GuardMetrics | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.config = config
        self.capacity = capacity
        self.metrics = metrics
        # slot -> request id (None: free); read-only for callers, who compare it in bulk
        self.request_ids: list[str | None] = [None] * capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._alloc_init(capacity, config.window)

    def _alloc_init(self, n: int, window: int) -> None:
        self.active = np.zeros(n, dtype=bool)
        self.tripped = np.zeros(n, dtype=bool)
        self.kept = np.zeros(n, dtype=bool)  # a high accept rate without repetition, counted
        self.checked = np.zeros(n, dtype=bool)
        self.generated = np.zeros(n, dtype=np.int64)
        self.steps = np.zeros(n, dtype=np.int64)  # speculative steps (proposed > 0)
        self.accepted = np.zeros(n, dtype=np.int64)
        self.proposed = np.zeros(n, dtype=np.int64)
        w = max(window, 1)
        self._ring_acc = np.zeros((n, w), dtype=np.int64)
        self._ring_prop = np.zeros((n, w), dtype=np.int64)
        self._ring_pos = np.zeros(n, dtype=np.int64)
        self._win_fill = np.zeros(n, dtype=np.int64)
        self._win_acc = np.zeros(n, dtype=np.int64)
        self._win_prop = np.zeros(n, dtype=np.int64)

    # ---- slot lifecycle -------------------------------------------------------------------

    def open(self, slot: int, request_id: str) -> None:
        """Start tracking ``request_id`` in ``slot`` (resets whatever the slot held)."""
        self._reset(slot)
        self.active[slot] = True
        self.request_ids[slot] = request_id

    def allocate(self, request_id: str) -> int:
        """Pick a free slot, open it and return it (for callers without their own slots)."""
        while self._free:
            slot = self._free.pop()
            if not self.active[slot]:
                self.open(slot, request_id)
                return slot
        raise RuntimeError(f"guard monitor full ({self.capacity} slots)")

    def request_id(self, slot: int) -> str | None:
        return self.request_ids[slot]

    def finish(self, slot: int) -> RequestStats | None:
        """End the request in ``slot``: record its histograms if it was judged; free the slot."""
        if not self.active[slot]:
            return None
        stats = self.stats(slot)
        if self.metrics is not None and stats.checked:
            self.metrics.accept_length.observe(stats.accept_length)
            self.metrics.accept_rate.observe(stats.accept_rate)
        self._reset(slot)
        self._free.append(slot)
        return stats

    def _reset(self, slot: int) -> None:
        self.active[slot] = self.tripped[slot] = self.checked[slot] = self.kept[slot] = False
        for arr in (
            self.generated,
            self.steps,
            self.accepted,
            self.proposed,
            self._ring_pos,
            self._win_fill,
            self._win_acc,
            self._win_prop,
        ):
            arr[slot] = 0
        self._ring_acc[slot] = 0
        self._ring_prop[slot] = 0
        self.request_ids[slot] = None

    def stats(self, slot: int) -> RequestStats:
        steps, acc, prop = int(self.steps[slot]), int(self.accepted[slot]), int(self.proposed[slot])
        return RequestStats(
            request_id=self.request_ids[slot],
            generated_tokens=int(self.generated[slot]),
            verify_steps=steps,
            accepted=acc,
            proposed=prop,
            accept_length=(acc + steps) / steps if steps else float("nan"),
            accept_rate=acc / prop if prop else float("nan"),
            checked=bool(self.checked[slot]),
            tripped=bool(self.tripped[slot]),
        )

    # ---- the per-step hot path ------------------------------------------------------------

    def observe(
        self,
        slots: ArrayLike,
        accepted: ArrayLike,
        proposed: ArrayLike,
        tokens: TokensOf | None = None,
    ) -> list[GuardTrip]:
        """Feed one verify step of a batch; return the requests that tripped in this step.

        ``slots`` must be unique within one call (numpy's indexed ``+=`` would drop repeats).
        ``proposed`` may be one number for the whole batch. Slots that are not open or already
        tripped are ignored. ``tokens(slot)``, read only for a request whose accept rate is
        over the limit, gives its output so far (the repetition evidence).
        """
        s = np.asarray(slots, dtype=np.intp).reshape(-1)
        a = np.asarray(accepted, dtype=np.float64).reshape(-1)
        p = np.asarray(proposed, dtype=np.float64)
        p = np.broadcast_to(p, s.shape) if p.ndim == 0 else p.reshape(-1)
        if not (s.shape == a.shape == p.shape):
            raise ValueError("slots, accepted and proposed must have the same length")
        live = self.active[s] & ~self.tripped[s]
        keep = live & (a >= 0) & (a <= p) & np.isfinite(p)  # NaN fails every comparison
        if not keep.all():
            n_invalid = int(np.count_nonzero(live & ~keep))
            if n_invalid and self.metrics is not None:
                self.metrics.invalid_steps.inc(n_invalid)
            s, a, p = s[keep], a[keep], p[keep]
        if s.size == 0:
            return []
        ai, pi = a.astype(np.int64), p.astype(np.int64)
        self._accumulate(s, ai, pi)
        return self._judge(s, tokens)

    def observe_one(
        self, slot: int, accepted: float, proposed: float, tokens: TokensOf | None = None
    ) -> GuardTrip | None:
        """Scalar convenience for callers that step one request at a time."""
        trips = self.observe([slot], [accepted], [proposed], tokens)
        return trips[0] if trips else None

    def _accumulate(self, s: np.ndarray, ai: np.ndarray, pi: np.ndarray) -> None:
        self.generated[s] += ai + 1
        spec = pi > 0
        self.steps[s] += spec
        self.accepted[s] += ai
        self.proposed[s] += pi
        w = self.config.window
        if w <= 0:
            return
        if not spec.all():
            s, ai, pi = s[spec], ai[spec], pi[spec]
        pos = self._ring_pos[s]
        self._win_acc[s] += ai - self._ring_acc[s, pos]
        self._win_prop[s] += pi - self._ring_prop[s, pos]
        self._ring_acc[s, pos] = ai
        self._ring_prop[s, pos] = pi
        self._ring_pos[s] = (pos + 1) % w
        self._win_fill[s] = np.minimum(self._win_fill[s] + 1, w)

    def _judge(self, s: np.ndarray, tokens: TokensOf | None = None) -> list[GuardTrip]:
        cfg = self.config
        steps = self.steps[s]
        eligible = (self.generated[s] > cfg.min_generated_tokens) & (steps > 0)
        newly = eligible & ~self.checked[s]
        if newly.any():
            self.checked[s[newly]] = True
            if self.metrics is not None:
                self.metrics.checked.inc(int(np.count_nonzero(newly)))
        if not cfg.enabled or not eligible.any():
            return []
        # denominators are > 0 wherever the result matters (eligible rows, full windows)
        acc = self.accepted[s]
        low_req = (acc + steps) / np.maximum(steps, 1) < cfg.min_accept_length
        high_req = acc / np.maximum(self.proposed[s], 1) > cfg.max_accept_rate
        low_win = high_win = np.zeros_like(eligible)
        if cfg.window > 0:
            full = self._win_fill[s] == cfg.window
            wacc = self._win_acc[s]
            low_win = full & ((wacc + cfg.window) / cfg.window < cfg.min_accept_length)
            high_win = full & (wacc / np.maximum(self._win_prop[s], 1) > cfg.max_accept_rate)
        trip = eligible & (low_req | high_req | low_win | high_win)
        if not trip.any():
            return []
        out = []
        for i in np.flatnonzero(trip):
            slot, low = int(s[i]), bool(low_req[i] or low_win[i])
            if not low and not self._repeats(slot, tokens):
                continue
            out.append(self._trip(slot, bool(low_req[i]), bool(low_win[i]), bool(high_req[i])))
        return out

    def _repeats(self, slot: int, tokens: TokensOf | None) -> bool:
        """Whether a request over the accept-rate limit also repeats (always, without the
        tokens or with the rule off); one that does not is kept and counted once."""
        period = self.config.repetition_period
        if tokens is None or period <= 0:
            return True
        output = tokens(slot)
        if short_period(output, max_period=period) is not None:
            return True
        if len(output) < REPETITION_WINDOW + period:
            return False  # too few tokens to tell yet: not a trip, not counted as kept
        if not self.kept[slot]:
            self.kept[slot] = True
            if self.metrics is not None:
                self.metrics.kept_without_repetition.inc()
        return False

    def _trip(self, slot: int, low_req: bool, low_win: bool, high_req: bool) -> GuardTrip:
        """Build, count and log one trip (rare path, plain Python)."""
        self.tripped[slot] = True
        reason: Reason
        scope: Scope
        if low_req or low_win:
            reason, scope = "low_accept_length", "request" if low_req else "window"
        else:
            reason, scope = "high_accept_rate", "request" if high_req else "window"
        st = self.stats(slot)
        wfill = int(self._win_fill[slot])
        wacc, wprop = int(self._win_acc[slot]), int(self._win_prop[slot])
        trip = GuardTrip(
            request_id=st.request_id or f"slot-{slot}",
            slot=slot,
            reason=reason,
            scope=scope,
            generated_tokens=st.generated_tokens,
            verify_steps=st.verify_steps,
            accept_length=st.accept_length,
            accept_rate=st.accept_rate,
            window_accept_length=(wacc + wfill) / wfill if wfill else float("nan"),
            window_accept_rate=wacc / wprop if wprop else float("nan"),
        )
        if self.metrics is not None:
            self.metrics.trips.labels(reason=reason).inc()
        logger.warning(
            "cas guard trip: request_id=%s reason=%s scope=%s generated_tokens=%d "
            "accept_length=%.3f accept_rate=%.3f window_accept_length=%.3f "
            "window_accept_rate=%.3f",
            trip.request_id,
            reason,
            scope,
            trip.generated_tokens,
            trip.accept_length,
            trip.accept_rate,
            trip.window_accept_length,
            trip.window_accept_rate,
        )
        return trip
