"""Hook the quality gate into SGLang's per-request speculative verify accounting (0.5.23).

Where SGLang counts: ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens(result, batch)``
(``srt/managers/scheduler_components/batch_result_processor.py``) runs once per decode batch in
the scheduler process; for every live request it does ``req.spec_verify_ct += 1`` and adds
``result.num_correct_drafts_per_req_cpu[i]`` to ``req.spec_num_correct_drafts``. The tokenizer
later reports ``spec_accept_rate = correct / (verify_ct * (speculative_num_draft_tokens - 1))``
and ``spec_accept_length = completion_tokens / verify_ct``.

The patch (two wrappers, each called once per batch, never per token):

1. after ``_resolve_spec_v2_tokens``: feed the batch's accepted and proposed draft counts to a
   :class:`~cas_engine.guard.GuardMonitor` indexed by the request's ``req_pool_idx``; for each
   trip set ``req.to_finish = FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE, ...)``.
   SGLang consumes ``to_finish`` in ``update_finish_state`` in the same step, frees the KV, and
   the tokenizer manager answers a non-streaming request with HTTP 503 (the router retries it)
   and ends a stream with ``data: {"error": {..., "code": 503}}`` (serving_chat's abort path).
2. after ``process_batch_result_decode``: finished requests leave the monitor (histograms).

Every attention-TP (and CP) rank of a decode instance runs the same batch, so each judges and
aborts the same requests (they must agree); only the first rank of each attention group
(``attn_tp_rank == attn_cp_rank == 0``, read from SGLang's ``runtime_context.get_parallel()``)
records the metrics, so a trip or a checked request counts once, not ``tp_size`` times.

Safety: :func:`check_targets` refuses (``GuardPatchError``) when a hooked method is missing,
its parameters changed, or its source no longer shows the accounting we rely on; the wrappers
never raise into SGLang (an internal error is logged once and the step proceeds unguarded).
Ownership: one :class:`GuardAdapter` per scheduler process, stored on the patched class.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from cas_engine.guard import GuardConfig, GuardMetrics, GuardMonitor, GuardTrip

logger = logging.getLogger("cas_engine.sglang.guard_patch")

TARGET_MODULE = "sglang.srt.managers.scheduler_components.batch_result_processor"
TARGET_CLASS = "SchedulerBatchResultProcessor"
HOOK_PARAMS = {
    "_resolve_spec_v2_tokens": ("self", "result", "batch"),
    "process_batch_result_decode": ("self", "batch", "result"),
}
SOURCE_MARKERS = {
    "_resolve_spec_v2_tokens": (
        "req.spec_verify_ct += 1",
        "num_correct_drafts_per_req_cpu",
        "req.is_retracted or req.finished()",
    ),
}
ORIGINAL_ATTR = "__cas_guard_original__"
DEFAULT_CAPACITY = 4096


class GuardPatchError(RuntimeError):
    """The SGLang code to hook is not what this patch was written for."""


def check_targets(cls: type) -> list[str]:
    """Problems that forbid patching ``cls`` (empty list: safe to patch)."""
    problems = []
    for name, params in HOOK_PARAMS.items():
        fn = getattr(cls, name, None)
        if fn is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        if hasattr(fn, ORIGINAL_ATTR):
            problems.append(f"{cls.__name__}.{name} is already patched")
            continue
        found = tuple(inspect.signature(fn).parameters)
        if found != params:
            problems.append(f"{cls.__name__}.{name}{found} != expected parameters {params}")
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = ""
        problems += [
            f"{cls.__name__}.{name} no longer contains {marker!r}"
            for marker in SOURCE_MARKERS.get(name, ())
            if marker not in source
        ]
    return problems


REQ_MODULE = "sglang.srt.managers.schedule_batch"
REQ_CLASS = "Req"
REQ_FINISHED_MARKER = "return self.finished_reason is not None"


def check_req_class(req_cls: Any) -> list[str]:
    """``Req.finished()`` must still mean ``finished_reason is not None`` (read in bulk)."""
    try:
        source = inspect.getsource(req_cls.finished)
    except (AttributeError, OSError, TypeError) as exc:
        return [f"{req_cls.__name__}.finished unreadable: {exc}"]
    if REQ_FINISHED_MARKER not in source:
        return [f"{req_cls.__name__}.finished no longer contains {REQ_FINISHED_MARKER!r}"]
    return []


def _default_abort_factory() -> Callable[[GuardTrip], Any]:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    def make(trip: GuardTrip) -> Any:
        return FINISH_ABORT(trip.message(), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailable")

    return make


def _default_reporting_rank() -> bool:
    """Whether this scheduler process records the gate's metrics: the first rank of its
    attention group. Unreadable ranks (a single-process engine) count as the first."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        return int(parallel.attn_tp_rank) == 0 and int(parallel.attn_cp_rank) == 0
    except (AttributeError, RuntimeError, ValueError):
        return True


def _default_proposed_per_step() -> int:
    from sglang.srt.runtime_context import get_spec

    return int(get_spec().speculative_num_draft_tokens) - 1


@dataclass
class GuardAdapter:
    """Per-process state between SGLang's scheduler and the monitor."""

    config: GuardConfig
    metrics: GuardMetrics | None
    abort_factory: Callable[[GuardTrip], Any]
    proposed_per_step: Callable[[], int]
    reporting_rank: Callable[[], bool] = lambda: True
    monitor: GuardMonitor | None = None
    rid_slot: dict[str, int] = field(default_factory=dict)
    _proposed: int | None = None
    errors: int = 0

    def _monitor_for(self, processor: Any) -> GuardMonitor:
        if self.monitor is None:
            pool = getattr(processor, "req_to_token_pool", None)
            capacity = int(getattr(pool, "size", 0) or DEFAULT_CAPACITY) + 1
            metrics = self.metrics if self.reporting_rank() else None  # count once per request
            self.monitor = GuardMonitor(self.config, capacity, metrics=metrics)
        return self.monitor

    def observe_batch(self, processor: Any, batch: Any, result: Any) -> list[GuardTrip]:
        """Feed one verify step; abort tripped requests via ``req.to_finish``.

        Hot path: two list comprehensions over the batch (slots; rows whose slot owner is not
        this request or that SGLang skips), then one vectorised ``observe``. Rows needing
        attention (new requests, retracted or finished rows) are rare and handled one by one.
        """
        mon = self._monitor_for(processor)
        if self._proposed is None:
            self._proposed = self.proposed_per_step()
        reqs = batch.reqs
        accepted = result.num_correct_drafts_per_req_cpu
        slots = [r.kv.req_pool_idx for r in reqs]
        owners, cap = mon.request_ids, mon.capacity
        odd = [
            i
            for i, (r, s) in enumerate(zip(reqs, slots, strict=True))
            if r.is_retracted or s is None or s >= cap or owners[s] != r.rid
        ]
        skip = [i for i in odd if not self._admit(mon, reqs[i], slots[i])]
        if skip:
            drop = set(skip)
            keep = [i for i in range(len(reqs)) if i not in drop]
            slots = [slots[i] for i in keep]
            accepted = [accepted[i] for i in keep]
        if not slots:
            return []
        by_slot: dict[int, Any] = {}

        def output_of(slot: int) -> Any:
            """A request's output token ids (`Req.output_ids`), for the repetition rule: only
            asked for a request over the accept-rate limit, so the map is built rarely."""
            if not by_slot:
                by_slot.update({r.kv.req_pool_idx: r for r in reqs})
            return by_slot[slot].output_ids

        trips = mon.observe(slots, accepted, self._proposed, output_of)
        if trips:
            by_slot.update({r.kv.req_pool_idx: r for r in reqs})
            for trip in trips:
                req = by_slot[trip.slot]
                if req.to_finish is None:  # an earlier abort reason (if any) wins
                    req.to_finish = self.abort_factory(trip)
        return trips

    def _admit(self, mon: GuardMonitor, req: Any, slot: int | None) -> bool:
        """Decide about an unusual row: count it (opening its slot if new) or skip it."""
        if req.is_retracted or req.finished():
            return False  # SGLang does not count these rows either
        if slot is None or not 0 <= slot < mon.capacity:
            return False
        if mon.request_ids[slot] != req.rid:
            self._open(mon, slot, req.rid)
        return True

    def _open(self, mon: GuardMonitor, slot: int, rid: str) -> None:
        old = mon.request_id(slot)
        if old is not None:  # finished without us seeing it: close it now
            self.rid_slot.pop(old, None)
            mon.finish(slot)
        mon.open(slot, rid)
        self.rid_slot[rid] = slot

    def finish_batch(self, batch: Any) -> None:
        """Close the monitor slots of requests that finished in this batch.

        Reads ``req.finished_reason`` directly (what ``Req.finished()`` returns, checked by
        :func:`check_req_class`): an attribute read per row instead of a method call.
        """
        if self.monitor is None:
            return
        for req in [r for r in batch.reqs if r.finished_reason is not None]:
            slot = self.rid_slot.pop(req.rid, None)
            if slot is not None:
                self.monitor.finish(slot)


@dataclass
class GuardPatch:
    """Handle of an installed patch; :meth:`uninstall` restores the original methods."""

    cls: type
    adapter: GuardAdapter
    originals: dict[str, Callable[..., Any]]

    def uninstall(self) -> None:
        for name, fn in self.originals.items():
            setattr(self.cls, name, fn)


def _safe(adapter: GuardAdapter, what: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # never break serving because of the gate
        adapter.errors += 1
        if adapter.errors == 1:
            logger.exception("cas guard: %s failed; this step is unguarded", what)


def install_guard_patch(
    config: GuardConfig,
    *,
    metrics: GuardMetrics | None = None,
    cls: type | None = None,
    abort_factory: Callable[[GuardTrip], Any] | None = None,
    proposed_per_step: Callable[[], int] | None = None,
    reporting_rank: Callable[[], bool] | None = None,
) -> GuardPatch:
    """Wrap the two hook methods of ``cls`` (default: SGLang's real class) with the gate.

    Raises :class:`GuardPatchError` listing every problem when the target does not match.
    """
    problems: list[str] = []
    if cls is None:
        import importlib

        cls = getattr(importlib.import_module(TARGET_MODULE), TARGET_CLASS)
        problems += check_req_class(getattr(importlib.import_module(REQ_MODULE), REQ_CLASS))
    problems += check_targets(cls)
    if problems:
        raise GuardPatchError("cannot install the cas guard patch: " + "; ".join(problems))
    adapter = GuardAdapter(
        config=config,
        metrics=metrics,
        abort_factory=abort_factory or _default_abort_factory(),
        proposed_per_step=proposed_per_step or _default_proposed_per_step,
        reporting_rank=reporting_rank or _default_reporting_rank,
    )
    target: Any = cls
    resolve = target._resolve_spec_v2_tokens
    decode = target.process_batch_result_decode

    def _resolve_spec_v2_tokens(self: Any, result: Any, batch: Any) -> Any:
        out = resolve(self, result, batch)
        _safe(adapter, "observe", lambda: adapter.observe_batch(self, batch, result))
        return out

    def process_batch_result_decode(self: Any, batch: Any, result: Any) -> Any:
        out = decode(self, batch, result)
        _safe(adapter, "finish", lambda: adapter.finish_batch(batch))
        return out

    for wrapper, original in (
        (_resolve_spec_v2_tokens, resolve),
        (process_batch_result_decode, decode),
    ):
        setattr(wrapper, "__wrapped__", original)  # noqa: B010 - typed as a function
        setattr(wrapper, ORIGINAL_ATTR, original)
        setattr(cls, wrapper.__name__, wrapper)
    logger.info("cas guard patch installed on %s (%s)", cls.__name__, config)
    return GuardPatch(
        cls, adapter, {"_resolve_spec_v2_tokens": resolve, "process_batch_result_decode": decode}
    )
