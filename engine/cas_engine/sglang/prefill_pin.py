"""Prefill-side source-page pinning for SGLang's mooncake PD path (pinned SGLang 0.5.23).

What upstream does: when a room's transfer fails or is aborted, the prefill scheduler frees the
request's KV pages at once: ``handle_inflight_transfer_failure`` (a Failed poll from the inflight
queue: decode's ABORT marked the room Failed, a send failed, bootstrap timed out) and
``_retire_aborted_prefill_result`` (a local abort) both call ``release_kv_cache``. Meanwhile the
mooncake transfer worker may still be reading those pages for a chunk it already dequeued: it
counts such chunks in ``kv_mgr._staging_outstanding[room]`` (incremented at dequeue, decremented
when the send returns; chunks dequeued after the room failed are skipped) and marks a room whose
send failed or timed out with the batch possibly still running in
``kv_mgr._deferred_ack_poisoned_rooms`` (``_poison_unsettled_send``). The freed pages go to the
next request, whose prefill overwrites them while the old chunk is read.

What this patch changes (no upstream code copied), mapped to the kvfence ``WriteTracker``
rules: counted writes = ``_staging_outstanding``; abort skips queued chunks = upstream's Failed
check in ``transfer_worker`` (unchanged); a poisoned transfer never releases = pages of a
poisoned room stay pinned for the life of the process, counted.

1. ``release_kv_cache`` in the prefill module's globals is replaced by a pass-through that, only
   while one of the two failure paths above runs for that very request, records a
   :class:`SourcePin` (request, tree cache, arguments) on the scheduler instead of freeing.
   Every other caller is unaffected.
2. ``process_disagg_prefill_inflight_queue`` is wrapped: after upstream's pass, the scheduler
   resolves its pins. Each rank computes a local state per pin (``HOLD`` while its sender has a
   chunk outstanding for the room, ``POISONED`` if its sender poisoned the room, ``DRAINED``)
   and the states are MIN-reduced over the attention TP then CP groups with SGLang's own
   ``poll_and_all_reduce_attn_cp_tp_group`` (the reduction upstream uses for the polls that
   decided the failure). A pin is released on every rank in the same pass once the reduced state
   is ``DRAINED`` (every rank's sender drained), and kept forever once it is ``POISONED`` (some
   rank poisoned it and none still holds). ``HOLD`` is 0, so SGLang's failure injection
   (``SGLANG_TEST_DISAGG_FAILURE_PROB``, which reports 0) only delays a release.
3. ``Scheduler.is_fully_idle`` reports busy while pins exist (outside health checks), so the idle
   leak check does not count pinned pages as leaked, like upstream does for decode's holds.
4. ``_retire_aborted_prefill_result`` answers False for a request already pinned (upstream's
   "already retired" answer once the KV is released), so a later result of the same request
   under overlap scheduling is neither streamed nor released twice.
5. The first inflight pass refuses to run (:class:`StrictReclaimError`) when the mooncake
   manager has deferred release off: then a failed send is not marked poisoned.

Why the ranks agree: pins are created by failure paths whose decisions are already identical on
every rank of the group (polls are MIN-reduced; local aborts are broadcast to all TP ranks), in
the same order, and resolved at the same point of the loop with one collective per pass over the
same list, so every rank frees the same requests in the same pass and admission stays identical.
With pipeline parallelism (pp_size > 1) stages resolve inflight requests at different loop steps,
so a per-stage hold would diverge admission across stages: there the patch does not pin (logs
once, upstream behaviour) and the decode-side quarantine remains the protection.

Before patching, :func:`check_prefill_targets` verifies each function's presence and the source
lines this reasoning depends on (:class:`~cas_engine.sglang.reclaim.StrictReclaimError`
otherwise). The pages are read, not written, by the late chunk; what it sends lands in decode
pages that strict reclaim keeps quarantined until this rank acknowledges, which it does only when
drained, so this patch is defence in depth for the source side.

Limits: the counters are keyed by ``bootstrap_room``; if a new request reuses the room id while
an old chunk is still in flight, upstream's ``update_status`` resets them and the pin may be
released early (room ids are random 63-bit values from the router). nixl and mori keep the same
counter, but only the mooncake worker's use of it is checked at start-up.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

from cas_engine.kvfence.metrics import KvFenceMetrics
from cas_engine.sglang.reclaim import StrictReclaimError, check_fingerprints, import_sglang_module
from cas_engine.sglang.version import SGLangVersionError, require_sglang

log = logging.getLogger(__name__)

PREFILL_MODULE = "sglang.srt.disaggregation.prefill"
MIXIN_CLASS = "SchedulerDisaggregationPrefillMixin"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
SCHEDULER_CLASS = "Scheduler"
MOONCAKE_MODULE = "sglang.srt.disaggregation.mooncake.conn"
MOONCAKE_CLASS = "MooncakeKVManager"

RELEASE_FN = "release_kv_cache"
REDUCE_FN = "poll_and_all_reduce_attn_cp_tp_group"

# Reduced (MIN) pin states: HOLD dominates, then POISONED, DRAINED only if every rank is drained.
HOLD, POISONED, DRAINED = 0, 1, 2

MIXIN_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "process_disagg_prefill_inflight_queue": (
        "polls = poll_and_all_reduce_attn_cp_tp_group(",
        "self.handle_inflight_transfer_failure(req)",
        "if len(self.disagg_prefill_inflight_queue) == 0:",
    ),
    "handle_inflight_transfer_failure": (
        "req.disagg_kv_sender.failure_exception()",
        "release_kv_cache(req, self.tree_cache, checkpoint=True)",
    ),
    "_retire_aborted_prefill_result": (
        "sender.abort()",
        "release_kv_cache(req, self.tree_cache, checkpoint=False)",
    ),
}
SCHEDULER_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "is_fully_idle": (
        "if not for_health_check:",
        "idle &= len(self.disagg_prefill_inflight_queue) == 0",
        # decode: what reclaim's idle observation relies on (held rooms keep it busy)
        "idle &= not self.disagg_decode_transfer_queue.has_pending_deferred_releases()",
    ),
}
# What "a chunk is outstanding" and "poisoned" mean in the mooncake sender.
SENDER_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "transfer_worker": (
        "self._staging_outstanding[kv_chunk.room] += 1",
        "self._staging_outstanding[kv_chunk.room] -= 1",
        "or self.check_status(kv_chunk.room) == KVPoll.Failed",
        "self._poison_unsettled_send(kv_chunk.room)",
        "self.poison_deferred_ack_room(kv_chunk.room)",
    ),
    "_poison_unsettled_send": ("self.poison_deferred_ack_room(room)",),
    "poison_deferred_ack_room": ("self._deferred_ack_poisoned_rooms.add(room)",),
}

_MARK = "_cas_prefill_pin"
_PINS = "_cas_source_pins"


@dataclass(frozen=True)
class PrefillTargets:
    """The SGLang classes the patch hooks (real ones, or compiled copies in tests)."""

    mixin: type
    scheduler: type | None
    sender_mgr: type


def load_prefill_targets() -> PrefillTargets:
    """Import the pinned SGLang's prefill mixin, Scheduler and mooncake manager."""
    try:
        require_sglang()
    except SGLangVersionError as exc:
        raise StrictReclaimError(str(exc)) from exc
    found: list[type] = []
    for module_name, cls_name in (
        (PREFILL_MODULE, MIXIN_CLASS),
        (SCHEDULER_MODULE, SCHEDULER_CLASS),
        (MOONCAKE_MODULE, MOONCAKE_CLASS),
    ):
        module = import_sglang_module(module_name)
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type):
            raise StrictReclaimError(f"{module_name}.{cls_name} not found")
        found.append(cls)
    return PrefillTargets(mixin=found[0], scheduler=found[1], sender_mgr=found[2])


def check_prefill_targets(targets: PrefillTargets) -> None:
    """Raise :class:`StrictReclaimError` unless every hooked function is what we expect."""
    check_fingerprints(targets.mixin, MIXIN_FINGERPRINTS)
    check_fingerprints(targets.sender_mgr, SENDER_FINGERPRINTS, inherited=True)
    if targets.scheduler is not None:
        check_fingerprints(targets.scheduler, SCHEDULER_FINGERPRINTS)
    module_globals = _module_globals(targets.mixin)
    for name in (RELEASE_FN, REDUCE_FN):
        if not callable(module_globals.get(name)):
            raise StrictReclaimError(
                f"{targets.mixin.__module__}.{name} is missing; prefill source-page pinning "
                "cannot be applied to this SGLang"
            )


def _module_globals(mixin: type) -> dict[str, Any]:
    """Globals of the prefill module, read through an undecorated method of the mixin."""
    method = mixin.__dict__.get("handle_inflight_transfer_failure")
    if method is None:
        raise StrictReclaimError(f"{mixin.__name__}.handle_inflight_transfer_failure is missing")
    return inspect.unwrap(method).__globals__  # type: ignore[no-any-return]


@dataclass
class SourcePin:
    """A failed room's deferred ``release_kv_cache`` call, held until every rank drained."""

    req: Any
    tree_cache: Any
    kwargs: dict[str, Any]
    kv_mgr: Any
    room: Any
    pinned_at: float
    seen_poisoned: bool = False  # this rank saw its sender poison the room (sticky)
    poisoned: bool = False  # the group agreed: pinned for good

    def local_state(self) -> int:
        """This rank's view: HOLD while a chunk is outstanding, else POISONED or DRAINED."""
        mgr = self.kv_mgr
        if mgr is None or self.room is None:
            return DRAINED
        if mgr._staging_outstanding.get(self.room, 0) > 0:
            return HOLD
        if self.room in getattr(mgr, "_deferred_ack_poisoned_rooms", ()):
            self.seen_poisoned = True
        return POISONED if self.seen_poisoned else DRAINED


class _Flag:
    """A poller for SGLang's poll reduction that reports a fixed pin state."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def poll(self) -> int:
        return self.value


@dataclass
class PrefillPinPatch:
    """State of the installed patch (one per process) and what it observed."""

    metrics: KvFenceMetrics
    poisoned_gauge: Gauge
    poisoned_budget_rooms: int | None = None
    clock: Callable[[], float] = time.monotonic
    pinned_rooms: int = 0
    poisoned_rooms: int = 0
    released: int = 0
    _capture: threading.local = field(default_factory=threading.local)
    _warned_pp: bool = False

    # ---- capture (inside the wrapped failure paths) --------------------------------------------

    @contextmanager
    def capturing(self, scheduler: Any, req: Any) -> Iterator[None]:
        """While active, ``release_kv_cache(req, ...)`` is recorded as a pin, not run."""
        if _pp_size(scheduler) > 1:
            if not self._warned_pp:
                self._warned_pp = True
                log.warning(
                    "prefill source-page pinning is off with pipeline parallelism (stages "
                    "resolve failures at different steps); decode-side quarantine still holds"
                )
            yield
            return
        previous = getattr(self._capture, "target", None)
        self._capture.target = (scheduler, req)
        try:
            yield
        finally:
            self._capture.target = previous

    def release_or_pin(
        self, original: Callable[..., Any], req: Any, tree_cache: Any, kwargs: dict[str, Any]
    ) -> Any:
        """The replacement ``release_kv_cache``: pin the captured request, pass others through."""
        target = getattr(self._capture, "target", None)
        if target is None or target[1] is not req:
            return original(req, tree_cache, **kwargs)
        scheduler = target[0]
        if self.is_pinned(scheduler, req):
            return None  # one deferred release per request
        sender = getattr(req, "disagg_kv_sender", None)
        pin = SourcePin(
            req=req,
            tree_cache=tree_cache,
            kwargs=dict(kwargs),
            kv_mgr=getattr(sender, "kv_mgr", None),
            room=getattr(req, "bootstrap_room", None),
            pinned_at=self.clock(),
        )
        scheduler.__dict__.setdefault(_PINS, []).append(pin)
        self.pinned_rooms += 1
        self.metrics.pinned_rooms.inc()
        return None

    @staticmethod
    def is_pinned(scheduler: Any, req: Any) -> bool:
        return any(pin.req is req for pin in scheduler.__dict__.get(_PINS) or ())

    # ---- resolution (after each inflight-queue pass) --------------------------------------------

    def resolve(
        self, scheduler: Any, original_release: Callable[..., Any], reduce: Callable[..., Any]
    ) -> None:
        """Agree on every open pin across the TP/CP group; release the drained ones."""
        pins: list[SourcePin] = scheduler.__dict__.get(_PINS) or []
        open_pins = [p for p in pins if not p.poisoned]
        if not open_pins:
            return
        local = [_Flag(p.local_state()) for p in open_pins]
        agreed = reduce(local, scheduler.attn_cp_cpu_group, scheduler.attn_tp_cpu_group)
        keep = [p for p in pins if p.poisoned]
        for pin, state in zip(open_pins, agreed, strict=True):
            if int(state) == DRAINED:
                self._release(pin, original_release)
            elif int(state) == POISONED:
                pin.poisoned = True
                self.poisoned_rooms += 1
                self.metrics.poisoned.inc()
                log.error(
                    "prefill room %s: a transfer may still read its KV pages (poisoned on some "
                    "rank); the pages stay pinned for the life of this process",
                    pin.room,
                )
                keep.append(pin)
            else:
                keep.append(pin)
        scheduler.__dict__[_PINS] = keep
        self.poisoned_gauge.set(self.poisoned_rooms)
        self.metrics.unhealthy.set(0.0 if self.health()[0] else 1.0)

    def _release(self, pin: SourcePin, original_release: Callable[..., Any]) -> None:
        self.pinned_rooms -= 1
        self.released += 1
        self.metrics.pinned_rooms.dec()
        try:
            original_release(pin.req, pin.tree_cache, **pin.kwargs)
        except Exception:  # isolate one failed release, like upstream's deferred release
            log.exception("deferred release of prefill room %s failed", pin.room)

    def health(self) -> tuple[bool, str]:
        """False while more rooms are pinned for good than the budget allows (drain the pod)."""
        budget = self.poisoned_budget_rooms
        if budget is None or self.poisoned_rooms <= budget:
            return True, ""
        return False, (
            f"prefill KV: {self.poisoned_rooms} rooms pinned after poisoned transfers (budget "
            f"{budget}); their pages can never be proven idle, drain this pod"
        )


def _pp_size(scheduler: Any) -> int:
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    return int(getattr(queue, "pp_size", 1) or 1)


def pinned_sources(scheduler: Any) -> list[SourcePin]:
    """The pins a scheduler holds (for tests and debugging)."""
    return list(scheduler.__dict__.get(_PINS) or [])


def install_prefill_pin(
    targets: PrefillTargets | None = None,
    *,
    metrics: KvFenceMetrics | None = None,
    poisoned_budget_rooms: int | None = 16,
    clock: Callable[[], float] = time.monotonic,
) -> PrefillPinPatch:
    """Patch the prefill mixin (default: the pinned SGLang's). Idempotent per mixin class."""
    targets = targets if targets is not None else load_prefill_targets()
    existing = targets.mixin.__dict__.get(_MARK)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    check_prefill_targets(targets)
    metrics = metrics if metrics is not None else KvFenceMetrics()
    patch = PrefillPinPatch(
        metrics=metrics,
        poisoned_budget_rooms=poisoned_budget_rooms,
        clock=clock,
        poisoned_gauge=Gauge(
            "cas_kv_poisoned_source_rooms",
            "Prefill rooms whose KV pages stay pinned because a transfer of them was poisoned",
            registry=metrics.registry,
        ),
    )
    module_globals = _module_globals(targets.mixin)
    original_release = module_globals[RELEASE_FN]
    reduce = module_globals[REDUCE_FN]

    @functools.wraps(original_release)
    def release_kv_cache(req: Any, tree_cache: Any, **kwargs: Any) -> Any:
        return patch.release_or_pin(original_release, req, tree_cache, kwargs)

    module_globals[RELEASE_FN] = release_kv_cache
    for name in ("handle_inflight_transfer_failure", "_retire_aborted_prefill_result"):
        _wrap_capture(targets.mixin, name, patch)
    _wrap_inflight(targets.mixin, patch, original_release, reduce)
    if targets.scheduler is not None:
        _wrap_idle(targets.scheduler)
    setattr(targets.mixin, _MARK, patch)
    log.info("prefill source-page pinning installed on %s", targets.mixin.__name__)
    return patch


def _wrap_capture(cls: type, name: str, patch: PrefillPinPatch) -> None:
    original = cls.__dict__[name]
    retire = name == "_retire_aborted_prefill_result"

    @functools.wraps(original)
    def wrapper(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if retire and patch.is_pinned(self, req):
            # Upstream answers False once a request's KV is released ("already retired");
            # a pinned request still holds its KV, so answer for it.
            return False
        with patch.capturing(self, req):
            return original(self, req, *args, **kwargs)

    setattr(cls, name, wrapper)


def _wrap_inflight(
    cls: type, patch: PrefillPinPatch, original_release: Callable[..., Any], reduce: Any
) -> None:
    name = "process_disagg_prefill_inflight_queue"
    original = cls.__dict__[name]
    checked: set[int] = set()

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if id(self) not in checked:
            _require_poison_tracking(self)
            checked.add(id(self))
        done = original(self, *args, **kwargs)
        patch.resolve(self, original_release, reduce)
        return done

    setattr(cls, name, wrapper)


def _require_poison_tracking(scheduler: Any) -> None:
    """A mooncake sender records poisoned sends only with deferred release on; refuse otherwise."""
    mgr = getattr(getattr(scheduler, "disagg_prefill_bootstrap_queue", None), "kv_manager", None)
    if getattr(mgr, "supports_deferred_decode_kv_release", False) and not getattr(
        mgr, "enable_deferred_decode_kv_release", False
    ):
        raise StrictReclaimError(
            "prefill source-page pinning needs SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 "
            "(without it a failed send is not marked poisoned and its pages would be freed)"
        )


def _wrap_idle(cls: type) -> None:
    original = cls.__dict__["is_fully_idle"]
    if getattr(original, "_cas_prefill_pin", False):
        return

    @functools.wraps(original)
    def is_fully_idle(self: Any, *args: Any, **kwargs: Any) -> bool:
        idle = bool(original(self, *args, **kwargs))
        for_health_check = kwargs.get("for_health_check", args[0] if args else False)
        if idle and not for_health_check and self.__dict__.get(_PINS):
            return False
        return idle

    is_fully_idle._cas_prefill_pin = True  # type: ignore[attr-defined]
    cls.is_fully_idle = is_fully_idle  # type: ignore[attr-defined]
