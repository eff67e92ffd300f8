"""Prefill-side source-page pinning for SGLang's mooncake PD path (pinned SGLang 0.5.23).

Paths below are relative to ``sglang/srt`` of the installed SGLang 0.5.23.

What upstream does: when a room's transfer fails or is aborted, the prefill scheduler frees the
request's KV pages at once. Meanwhile the mooncake transfer worker may still be reading those
pages for a chunk it already dequeued: it counts such chunks in
``kv_mgr._staging_outstanding[room]`` (incremented at dequeue, mooncake/conn.py:2524, decremented
when the send returns, mooncake/conn.py:2845; chunks dequeued after the room failed are skipped,
mooncake/conn.py:2545-2558) and marks a room whose send failed or timed out with the batch
possibly still running in ``kv_mgr._deferred_ack_poisoned_rooms`` (``_poison_unsettled_send``,
mooncake/conn.py:2478-2486). The freed pages go to the next request, whose prefill overwrites
them while the old chunk is read.

The free paths, and what this patch does with each:

- ``handle_inflight_transfer_failure`` (disaggregation/prefill.py:1305; a Failed poll from the
  inflight queue: decode's ABORT marked the room Failed, a send failed, bootstrap timed out) and
  ``_retire_aborted_prefill_result`` (prefill.py:1349; a local abort of a request whose last
  prefill result came back): pinned.
- ``Scheduler.process_pending_chunked_abort`` (managers/scheduler.py:3819; a local abort of the
  request being chunk-prefilled, recorded by ``abort_request`` at scheduler.py:5678 and run at the
  start of the next step, prefill.py:654): pinned. Its earlier chunks were sent while it was
  still chunking (prefill.py:1444 without overlap, prefill.py:1125 with overlap, and the early
  cached-prefix send prefill.py:1499 from ``run_batch``, scheduler.py:4654), so one may be in the
  worker. ``sender.abort()`` (scheduler.py:3813) makes the worker skip the queued ones only.
  This call lives in the scheduler module, so that module's ``release_kv_cache`` global is
  replaced too. Only in PREFILL mode (the same test upstream makes at scheduler.py:3811).
- ``release_aborted_prefill_waiting_req`` (prefill.py:602; ``abort_request`` on a request of
  the waiting queue, scheduler.py:5696-5714): safe, not pinned. No chunk of such a request was
  ever queued for sending, because of the two facts below (A) and (B).
- ``optimistic_release_and_requeue`` (prefill.py:1811; the request is reset and requeued, the
  same ``req`` object starts a new attempt): safe, not pinned. Every call site runs only while
  ``req.pending_bootstrap`` is True: prefill.py:988, prefill.py:1098, prefill.py:1192 (the call
  at prefill.py:1214 is inside it) and prefill.py:1422 (``check_bootstrap`` returns True at
  once when the flag is False, prefill.py:1403-1404). By (A) no chunk of it was ever sent. (A
  pin that released ``req`` later would free the new attempt's pages, so this path could not
  be pinned by request anyway.)

(A) A chunk is queued for sending only while ``req.pending_bootstrap`` is False: the only
callers of ``send_kv_chunk`` are prefill.py:1073 (``if not req.pending_bootstrap``),
prefill.py:1125 (``... and not req.pending_bootstrap``), prefill.py:1195 (after
``handle_pending_bootstrap`` returned True, which it does only after ``finalize_bootstrap``,
prefill.py:1392, which clears the flag, prefill.py:443), prefill.py:1444 (``check_bootstrap``
returned True: the flag is False) and prefill.py:1499 (returns before it while the flag is set,
prefill.py:1474-1475). The flag is set only at prefill.py:416 (``create_sender``, before the
request is queued anywhere) and prefill.py:1821 (``optimistic_release_and_requeue``, whose call
sites all require it set already). So a request whose flag is set has sent nothing since its
sender was created.

(B) On the prefill side a request enters the waiting queue only from ``pop_bootstrapped``
(prefill.py:695, prefill.py:793) or from ``optimistic_release_and_requeue`` (prefill.py:1852);
``_add_request_to_queue`` appends to it only in NULL mode (scheduler.py:3488-3493) and sends a
PREFILL request to the bootstrap queue (scheduler.py:3498, ``create_sender``). The bootstrap
queue receives requests only there and at prefill.py:1841 (again with the flag set). A request
admitted to a batch leaves the waiting queue (scheduler.py:4319) before ``run_batch`` can send
its cached prefix (scheduler.py:4653-4654), and it comes back only through prefill.py:1852 or
prefill.py:1841, both with the flag set. With (A), a request in the waiting queue never had a
chunk queued.

``tests/engine/test_sglang_prefill_pin.py`` pins (A) and (B) down on the installed source (every
call site and its guard); :data:`MIXIN_FINGERPRINTS` and :data:`SCHEDULER_FINGERPRINTS` refuse to
start when one of these lines changed. As a tripwire, both safe paths count a call for a request
whose sender has sent something or whose room has a counted or poisoned chunk in
``cas_kv_unpinned_source_frees_total{path}`` and log an error (nothing else changes: whether to
pin must be decided identically on every rank, and these rank-local counters are not).

What this patch changes (no upstream code copied), mapped to the kvfence ``WriteTracker``
rules: counted writes = ``_staging_outstanding``; abort skips queued chunks = upstream's Failed
check in ``transfer_worker`` (unchanged); a poisoned transfer never releases = pages of a
poisoned room stay pinned for the life of the process, counted.

1. ``release_kv_cache`` in the prefill module's and the scheduler module's globals is replaced by
   a pass-through that, only while one of the three pinned failure paths runs for that very
   request, records a :class:`SourcePin` (request, tree cache, arguments, the original release)
   on the scheduler instead of freeing. Every other caller is unaffected.
2. ``process_disagg_prefill_inflight_queue`` is wrapped: after upstream's pass, the scheduler
   resolves its pins. Each rank computes a local state per pin (``POISONED`` if its sender
   poisoned the room, or if a chunk is counted and a transfer worker thread is dead, see below;
   else ``HOLD`` while its sender has a chunk outstanding for the room; else ``DRAINED``) and the
   states are MIN-reduced over the attention TP then CP groups with SGLang's own
   ``poll_and_all_reduce_attn_cp_tp_group`` (the reduction upstream uses for the polls that
   decided the failure). A pin is released on every rank in the same pass once the reduced state
   is ``DRAINED`` (every rank's sender drained), and kept forever once it is ``POISONED`` (some
   rank poisoned it and none still holds). ``HOLD`` is 0, so SGLang's failure injection
   (``SGLANG_TEST_DISAGG_FAILURE_PROB``, which reports 0) only delays a release.
3. ``Scheduler.is_fully_idle`` reports busy while pins exist (outside health checks), so the idle
   leak check does not count pinned pages as leaked, like upstream does for decode's holds.
4. ``_retire_aborted_prefill_result`` answers False for a request already pinned (upstream's
   "already retired" answer once the KV is released), so a later result of the same request
   under overlap scheduling (also the in-flight chunk of a chunked request aborted by
   ``process_pending_chunked_abort``, prefill.py:1088-1091) is neither streamed nor released
   twice.
5. The first inflight pass refuses to run (:class:`StrictReclaimError`) when the mooncake
   manager has deferred release off: then a failed send is not marked poisoned.

A transfer worker that dies: ``transfer_worker`` catches ``Exception`` around each chunk,
poisons the room of the chunk it held (mooncake/conn.py:2878-2881) and re-raises, which ends the
thread (mooncake/conn.py:2882-2884; nothing restarts it, SGLang installs no thread excepthook).
The chunk's count is never decremented (the decrement at mooncake/conn.py:2845 is skipped), so a
pin that looked at the count first would stay ``HOLD`` forever, uncounted. A poisoned room is
therefore ``POISONED`` whatever its count: pinned for good, counted in
``cas_kv_poisoned_source_rooms``, and past the budget the engine reports unhealthy. A thread
ended by a ``BaseException`` poisons nothing; for that, a room with a counted chunk is also
``POISONED`` when one of the manager's transfer worker threads (``_worker_threads``,
mooncake/conn.py:358-373; told apart by the name ``threading.Thread`` gives an unnamed thread,
``Thread-N (transfer_worker)``) is no longer alive and the manager was not torn down
(``_stopped``, mooncake/conn.py:447). That may also pin a room whose chunk a live worker holds:
a leak, counted, in a process whose transfer path is already broken. Chunks still queued for a
dead worker are never read, so their rooms drain normally. A worker that hangs in a send keeps
its room ``HOLD``: the pages are really being read. Pins held longer than ``overdue_after_s``
(default 120 s) are counted in ``cas_kv_overdue_source_pins`` and logged once each; at most one
chunk per worker is in a send at a time, plus staging chunks re-queued while counted
(mooncake/conn.py:2520-2525).

Why the ranks agree: pins are created by failure paths whose decisions are already identical on
every rank of the group (polls are MIN-reduced; local aborts are broadcast to all TP ranks and
``process_pending_chunked_abort`` runs at the same point of each step), in the same order, and
resolved at the same point of the loop with one collective per pass over the same list, so every
rank frees the same requests in the same pass and admission stays identical. With pipeline
parallelism (pp_size > 1) stages resolve inflight requests at different loop steps, so a
per-stage hold would diverge admission across stages: there the patch does not pin (logs once,
upstream behaviour) and the decode-side quarantine remains the protection.

Before patching, :func:`check_prefill_targets` verifies each function's presence and the source
lines this reasoning depends on (:class:`~cas_engine.sglang.reclaim.StrictReclaimError`
otherwise). The pages are read, not written, by the late chunk; what it sends lands in decode
pages that strict reclaim keeps quarantined until this rank acknowledges, which it does only when
drained, so this patch is defence in depth for the source side.

Limits: the counters are keyed by ``bootstrap_room``; if a new request reuses the room id while
an old chunk is still in flight, upstream's ``update_status`` resets them and the pin may be
released early (room ids are random 63-bit values from the router). nixl and mori keep the same
counter, but only the mooncake worker's use of it is checked at start-up. Requests re-added by
preemption or a pause's retract (scheduler.py:4311, scheduler.py:4322, scheduler.py:5910) get a
new sender and are outside (A)/(B); they come from the running batch (managers/
schedule_policy.py:1723, scheduler.py:5848; the chunked request is kept in PREFILL,
scheduler.py:5863-5867), which the disaggregated prefill loop never fills
(``get_next_disagg_prefill_batch_to_run``, prefill.py:648-681, merges nothing into it).
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

from prometheus_client import Counter, Gauge

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
MODE_ENUM = "DisaggregationMode"
CHUNKED_ABORT_FN = "process_pending_chunked_abort"

# Reduced (MIN) pin states: HOLD dominates, then POISONED, DRAINED only if every rank is drained.
HOLD, POISONED, DRAINED = 0, 1, 2

DEFAULT_OVERDUE_S = 120.0
# threading.Thread names an unnamed thread "Thread-N (<target name>)" (CPython >= 3.10); the
# mooncake transfer workers are started unnamed with target=self.transfer_worker.
WORKER_NAME_SUFFIX = "(transfer_worker)"
WAITING_ABORT, OPTIMISTIC_REQUEUE = "waiting_abort", "optimistic_requeue"

MIXIN_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "process_disagg_prefill_inflight_queue": (
        "polls = poll_and_all_reduce_attn_cp_tp_group(",
        "self.handle_inflight_transfer_failure(req)",
        "if len(self.disagg_prefill_inflight_queue) == 0:",
        # (A): a parked request sends only once bootstrapped; requeues only while parked
        "if req.pending_bootstrap:",
        "if self.handle_pending_bootstrap(req, poll):",
        "self.optimistic_release_and_requeue(req)",
    ),
    "handle_inflight_transfer_failure": (
        "req.disagg_kv_sender.failure_exception()",
        "release_kv_cache(req, self.tree_cache, checkpoint=True)",
    ),
    "_retire_aborted_prefill_result": (
        "sender.abort()",
        "release_kv_cache(req, self.tree_cache, checkpoint=False)",
    ),
    # the two free paths shown safe (module docstring, (A) and (B))
    "release_aborted_prefill_waiting_req": (
        "sender.abort()",
        "release_kv_cache(req, self.tree_cache, checkpoint=False)",
    ),
    "optimistic_release_and_requeue": (
        "release_kv_cache(req, self.tree_cache, checkpoint=False)",
        "req.pending_bootstrap = True",
        "self.waiting_queue.insert(0, req)",
        "self.disagg_prefill_bootstrap_queue.queue.append(req)",
    ),
    "process_batch_result_disagg_prefill": (
        "if req.pending_bootstrap and should_force_retry(req):",
        "if req.pending_bootstrap and not still_chunking:",
        "if not req.pending_bootstrap:",
        "if self.enable_overlap and not req.pending_bootstrap:",
        "if not still_chunking and self._retire_aborted_prefill_result(req):",
    ),
    "process_prefill_chunk": (
        "if not self.check_bootstrap(req):",
        "self.optimistic_release_and_requeue(req)",
        "self.send_kv_chunk(req)",
    ),
    "check_bootstrap": (
        "if not req.pending_bootstrap:",
        "return self.handle_pending_bootstrap(req, polls[0])",
    ),
    "handle_pending_bootstrap": (
        "assert self.disagg_prefill_bootstrap_queue.finalize_bootstrap(req)",
    ),
    "maybe_send_cached_prefix_chunk": ("if req.pending_bootstrap or not allow_send:",),
}
SCHEDULER_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "is_fully_idle": (
        "if not for_health_check:",
        "idle &= len(self.disagg_prefill_inflight_queue) == 0",
        # decode: what reclaim's idle observation relies on (held rooms keep it busy)
        "idle &= not self.disagg_decode_transfer_queue.has_pending_deferred_releases()",
    ),
    CHUNKED_ABORT_FN: (
        "req = self._pending_chunked_abort_req",
        "if self.chunked_req is not req:",
        "if self.disaggregation_mode == DisaggregationMode.PREFILL:",
        "req.disagg_kv_sender.abort()",
        "release_kv_cache(req, self.tree_cache, checkpoint=False)",
    ),
    # (B): the waiting-queue abort, and admission taking requests out of the waiting queue
    "abort_request": (
        "req = self.waiting_queue.pop(i)",
        "self.release_aborted_prefill_waiting_req(req)",
    ),
    "_get_new_batch_prefill_raw": (
        "self.waiting_queue = [x for x in self.waiting_queue if x not in can_run_set]",
    ),
}
# What "a chunk is outstanding", "poisoned" and "a dead worker" mean in the mooncake sender.
SENDER_FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "transfer_worker": (
        "self._staging_outstanding[kv_chunk.room] += 1",
        "self._staging_outstanding[kv_chunk.room] -= 1",
        "or self.check_status(kv_chunk.room) == KVPoll.Failed",
        "self._poison_unsettled_send(kv_chunk.room)",
        "except Exception as e:",
        "self.poison_deferred_ack_room(kv_chunk.room)",
        "raise RuntimeError(",
    ),
    "_poison_unsettled_send": ("self.poison_deferred_ack_room(room)",),
    "poison_deferred_ack_room": ("self._deferred_ack_poisoned_rooms.add(room)",),
    "__init__": (
        "target=self.transfer_worker,",
        "self._worker_threads.append(t)",
    ),
    "teardown": ("self._stopped = True",),
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
    checked: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        (targets.mixin.__module__, _module_globals(targets.mixin), (RELEASE_FN, REDUCE_FN))
    ]
    if targets.scheduler is not None:
        check_fingerprints(targets.scheduler, SCHEDULER_FINGERPRINTS)
        sched_globals = _scheduler_globals(targets.scheduler)
        checked.append((targets.scheduler.__module__, sched_globals, (RELEASE_FN,)))
        if not hasattr(sched_globals.get(MODE_ENUM), "PREFILL"):
            raise StrictReclaimError(
                f"{targets.scheduler.__module__}.{MODE_ENUM}.PREFILL is missing; prefill "
                "source-page pinning cannot be applied to this SGLang"
            )
    for module_name, module_globals, names in checked:
        for name in names:
            if not callable(module_globals.get(name)):
                raise StrictReclaimError(
                    f"{module_name}.{name} is missing; prefill source-page pinning "
                    "cannot be applied to this SGLang"
                )


def _module_globals(mixin: type) -> dict[str, Any]:
    """Globals of the prefill module, read through an undecorated method of the mixin."""
    method = mixin.__dict__.get("handle_inflight_transfer_failure")
    if method is None:
        raise StrictReclaimError(f"{mixin.__name__}.handle_inflight_transfer_failure is missing")
    return inspect.unwrap(method).__globals__  # type: ignore[no-any-return]


def _scheduler_globals(scheduler: type) -> dict[str, Any]:
    """Globals of the scheduler module, read through ``process_pending_chunked_abort``."""
    method = scheduler.__dict__.get(CHUNKED_ABORT_FN)
    if method is None:
        raise StrictReclaimError(f"{scheduler.__name__}.{CHUNKED_ABORT_FN} is missing")
    return inspect.unwrap(method).__globals__  # type: ignore[no-any-return]


def dead_transfer_worker(mgr: Any) -> bool:
    """True when one of ``mgr``'s transfer worker threads ended without a teardown.

    Upstream never restarts a worker (mooncake/conn.py:2878-2884 re-raises), so a chunk it had
    counted is never decremented and never provably finished."""
    if getattr(mgr, "_stopped", False):
        return False  # teardown (a role switch) ends the workers on purpose
    for thread in getattr(mgr, "_worker_threads", None) or ():
        name = str(getattr(thread, "name", ""))
        if name.endswith(WORKER_NAME_SUFFIX) and not thread.is_alive():
            return True
    return False


def _may_be_read(req: Any) -> bool:
    """Rank-local: whether ``req``'s sender ever queued a chunk or its room has a counted or
    poisoned one (the tripwire of the paths shown safe)."""
    sender = getattr(req, "disagg_kv_sender", None)
    # CommonKVSender.curr_idx: 0 at creation, advanced by every send (common/conn.py:2139, :2271)
    if int(getattr(sender, "curr_idx", 0) or 0) > 0:
        return True
    mgr = getattr(sender, "kv_mgr", None)
    room = getattr(req, "bootstrap_room", None)
    if mgr is None or room is None:
        return False
    outstanding = getattr(mgr, "_staging_outstanding", None) or {}
    return bool(
        outstanding.get(room, 0) > 0 or room in getattr(mgr, "_deferred_ack_poisoned_rooms", ())
    )


@dataclass
class SourcePin:
    """A failed room's deferred ``release_kv_cache`` call, held until every rank drained."""

    req: Any
    tree_cache: Any
    kwargs: dict[str, Any]
    kv_mgr: Any
    room: Any
    pinned_at: float
    release: Callable[..., Any] | None = None  # the module's original release_kv_cache
    seen_poisoned: bool = False  # this rank saw its sender poison the room (sticky)
    dead_worker: bool = False  # ... or a chunk counted while a transfer worker is dead
    poisoned: bool = False  # the group agreed: pinned for good
    overdue_logged: bool = False

    def local_state(self) -> int:
        """This rank's view: POISONED (sticky), else HOLD while a chunk is outstanding, else
        DRAINED. Poisoned wins over a count: a worker that died after counting a chunk poisoned
        its room but never decrements (mooncake/conn.py:2878-2884)."""
        mgr = self.kv_mgr
        if mgr is None or self.room is None:
            return DRAINED
        if self.room in getattr(mgr, "_deferred_ack_poisoned_rooms", ()):
            self.seen_poisoned = True
        if self.seen_poisoned:
            return POISONED
        if mgr._staging_outstanding.get(self.room, 0) > 0:
            if dead_transfer_worker(mgr):
                self.seen_poisoned = self.dead_worker = True
                return POISONED
            return HOLD
        return DRAINED


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
    overdue_gauge: Gauge
    unpinned_counter: Counter
    poisoned_budget_rooms: int | None = None
    overdue_after_s: float = DEFAULT_OVERDUE_S
    clock: Callable[[], float] = time.monotonic
    pinned_rooms: int = 0
    poisoned_rooms: int = 0
    overdue_pins: int = 0
    unpinned_frees: int = 0
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
            release=original,
        )
        scheduler.__dict__.setdefault(_PINS, []).append(pin)
        self.pinned_rooms += 1
        self.metrics.pinned_rooms.inc()
        return None

    @staticmethod
    def is_pinned(scheduler: Any, req: Any) -> bool:
        return any(pin.req is req for pin in scheduler.__dict__.get(_PINS) or ())

    def check_unpinned_free(self, path: str, req: Any) -> None:
        """Tripwire of a path shown safe: count a free whose pages a chunk may read."""
        if not _may_be_read(req):
            return
        self.unpinned_frees += 1
        self.unpinned_counter.labels(path=path).inc()
        log.error(
            "prefill room %s (%s): its sender queued a chunk or the room has a counted or "
            "poisoned one, but this path frees its pages unpinned; the reasoning in "
            "cas_engine.sglang.prefill_pin no longer holds for this SGLang",
            getattr(req, "bootstrap_room", None),
            path,
        )

    # ---- resolution (after each inflight-queue pass) --------------------------------------------

    def resolve(
        self, scheduler: Any, original_release: Callable[..., Any], reduce: Callable[..., Any]
    ) -> None:
        """Agree on every open pin across the TP/CP group; release the drained ones."""
        pins: list[SourcePin] = scheduler.__dict__.get(_PINS) or []
        open_pins = [p for p in pins if not p.poisoned]
        if not open_pins:
            self._set_overdue(0)
            return
        local = [_Flag(p.local_state()) for p in open_pins]
        agreed = reduce(local, scheduler.attn_cp_cpu_group, scheduler.attn_tp_cpu_group)
        keep = [p for p in pins if p.poisoned]
        now = self.clock()
        overdue = 0
        for pin, state in zip(open_pins, agreed, strict=True):
            if int(state) == DRAINED:
                self._release(pin, original_release)
            elif int(state) == POISONED:
                pin.poisoned = True
                self.poisoned_rooms += 1
                self.metrics.poisoned.inc()
                log.error(
                    "prefill room %s: a transfer may still read its KV pages (%s on some "
                    "rank); the pages stay pinned for the life of this process",
                    pin.room,
                    "a worker died with a chunk counted" if pin.dead_worker else "poisoned",
                )
                keep.append(pin)
            else:
                keep.append(pin)
                held = now - pin.pinned_at
                if held >= self.overdue_after_s:
                    overdue += 1
                    if not pin.overdue_logged:
                        pin.overdue_logged = True
                        log.warning(
                            "prefill room %s: a transfer chunk has held its KV pages for "
                            "%.0f s; they stay pinned until it returns",
                            pin.room,
                            held,
                        )
        scheduler.__dict__[_PINS] = keep
        self._set_overdue(overdue)
        self.poisoned_gauge.set(self.poisoned_rooms)
        self.metrics.unhealthy.set(0.0 if self.health()[0] else 1.0)

    def _set_overdue(self, count: int) -> None:
        if count != self.overdue_pins:
            self.overdue_pins = count
            self.overdue_gauge.set(count)

    def _release(self, pin: SourcePin, original_release: Callable[..., Any]) -> None:
        self.pinned_rooms -= 1
        self.released += 1
        self.metrics.pinned_rooms.dec()
        release = pin.release if pin.release is not None else original_release
        try:
            release(pin.req, pin.tree_cache, **pin.kwargs)
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
    overdue_after_s: float = DEFAULT_OVERDUE_S,
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
        overdue_after_s=overdue_after_s,
        clock=clock,
        poisoned_gauge=Gauge(
            "cas_kv_poisoned_source_rooms",
            "Prefill rooms whose KV pages stay pinned because a transfer of them was poisoned",
            registry=metrics.registry,
        ),
        overdue_gauge=Gauge(
            "cas_kv_overdue_source_pins",
            "Prefill rooms whose KV pages a transfer chunk has held pinned for longer than "
            "the overdue threshold",
            registry=metrics.registry,
        ),
        unpinned_counter=Counter(
            "cas_kv_unpinned_source_frees",
            "Frees on a prefill path shown not to need a pin, of a request whose sender had "
            "queued a chunk (expected 0), by path",
            ["path"],
            registry=metrics.registry,
        ),
    )
    for path in (WAITING_ABORT, OPTIMISTIC_REQUEUE):
        patch.unpinned_counter.labels(path=path)
    module_globals = _module_globals(targets.mixin)
    original_release = module_globals[RELEASE_FN]
    reduce = module_globals[REDUCE_FN]
    _replace_release(module_globals, patch)
    for name in ("handle_inflight_transfer_failure", "_retire_aborted_prefill_result"):
        _wrap_capture(targets.mixin, name, patch)
    _wrap_tripwire(targets.mixin, "release_aborted_prefill_waiting_req", patch, WAITING_ABORT)
    _wrap_tripwire(targets.mixin, "optimistic_release_and_requeue", patch, OPTIMISTIC_REQUEUE)
    _wrap_inflight(targets.mixin, patch, original_release, reduce)
    if targets.scheduler is not None:
        sched_globals = _scheduler_globals(targets.scheduler)
        _replace_release(sched_globals, patch)
        _wrap_chunked_abort(targets.scheduler, patch, sched_globals[MODE_ENUM].PREFILL)
        _wrap_idle(targets.scheduler)
    setattr(targets.mixin, _MARK, patch)
    log.info("prefill source-page pinning installed on %s", targets.mixin.__name__)
    return patch


def _replace_release(module_globals: dict[str, Any], patch: PrefillPinPatch) -> None:
    original = module_globals[RELEASE_FN]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def release_kv_cache(req: Any, tree_cache: Any, **kwargs: Any) -> Any:
        return patch.release_or_pin(original, req, tree_cache, kwargs)

    release_kv_cache._cas_prefill_pin = True  # type: ignore[attr-defined]
    module_globals[RELEASE_FN] = release_kv_cache


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


def _wrap_tripwire(cls: type, name: str, patch: PrefillPinPatch, path: str) -> None:
    original = cls.__dict__[name]

    @functools.wraps(original)
    def wrapper(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        patch.check_unpinned_free(path, req)
        return original(self, req, *args, **kwargs)

    setattr(cls, name, wrapper)


def _wrap_chunked_abort(cls: type, patch: PrefillPinPatch, prefill_mode: Any) -> None:
    """Pin the chunked request ``process_pending_chunked_abort`` frees (PREFILL mode only:
    pins are resolved by the prefill inflight pass)."""
    original = cls.__dict__[CHUNKED_ABORT_FN]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        req = getattr(self, "_pending_chunked_abort_req", None)
        if (
            req is None
            or getattr(self, "chunked_req", None) is not req
            or getattr(self, "disaggregation_mode", None) != prefill_mode
        ):
            return original(self, *args, **kwargs)
        with patch.capturing(self, req):
            return original(self, *args, **kwargs)

    wrapper._cas_prefill_pin = True  # type: ignore[attr-defined]
    setattr(cls, CHUNKED_ABORT_FN, wrapper)


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
