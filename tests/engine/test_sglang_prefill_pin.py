"""Prefill source-page pinning against the REAL SGLang 0.5.23 mooncake PD code.

The prefill modules import torch at module level, so, as in ``test_sglang_reclaim.py``, the real
functions are compiled straight from the installed sglang files (names and line numbers kept)
with stubs only for torch/the allocator/the network:

- scheduler side (``prefill.py``): ``process_disagg_prefill_inflight_queue``,
  ``handle_inflight_transfer_failure``, ``_retire_aborted_prefill_result``,
  ``clear_pending_chunk_send``, ``maybe_release_metadata_buffer``,
  ``release_aborted_prefill_waiting_req``, ``optimistic_release_and_requeue``,
  ``handle_pending_bootstrap``, ``maybe_send_cached_prefix_chunk``; ``Scheduler.is_fully_idle``
  and ``Scheduler.process_pending_chunked_abort`` (``managers/scheduler.py``);
- the poll reduction (``utils.py``): ``poll_and_all_reduce_attn_cp_tp_group`` and what it calls,
  over a thread-backed fake gloo group so two TP ranks really MIN-reduce;
- the mooncake sender (``mooncake/conn.py`` + ``common/conn.py``): ``transfer_worker`` running in
  a thread (chunk counting at dequeue, the Failed skip, ``_poison_unsettled_send``, the handler
  that ends the thread on an exception),
  ``add_transfer_request``, ``_handle_deferred_abort_notification`` (decode's ABORT),
  ``update_status``/``conclude_transfer``/``_maybe_ack_drained_abort``/``poison_deferred_ack_room``
  and ``CommonKVSender.poll``/``clear``/``failure_exception``/``abort``.

Only ``send_kvcache`` (the RDMA/TCP write) is a stub: it blocks on a gate, so a chunk is really
"in flight" in the worker while the scheduler handles the failure (or raises, to end the worker
thread). ``CAS_TEST_UNPATCHED=1`` runs the same tests on unpatched code; every test marked
``guards`` then fails (checked by hand). The two free paths shown safe (a waiting-queue abort, an
optimistic requeue) have tests that pass either way: they run the real path, and
``test_safe_paths_rest_on_the_installed_source`` reads the installed source for every condition
the safety argument uses, so an SGLang change that breaks it fails there.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
import queue
import threading
import time
from array import array
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.kvfence import KvFenceMetrics
from cas_engine.sglang import prefill_pin
from cas_engine.sglang.reclaim import StrictReclaimError
from cas_engine.sglang.version import PINNED_SGLANG_VERSION, installed_sglang_version
from tests.engine.sglang_source import compile_from

if installed_sglang_version() != PINNED_SGLANG_VERSION:
    pytest.skip(
        f"sglang=={PINNED_SGLANG_VERSION} not installed (pip install --no-deps "
        f"sglang=={PINNED_SGLANG_VERSION})",
        allow_module_level=True,
    )

UNPATCHED = os.environ.get("CAS_TEST_UNPATCHED") == "1"
_SPEC = importlib.util.find_spec("sglang")  # top-level spec: does not run sglang/__init__
assert _SPEC is not None and _SPEC.origin is not None
SRT = Path(_SPEC.origin).parent / "srt"
DISAGG = SRT / "disaggregation"
WAIT_S = 5.0


# ---- a thread-backed gloo group: ranks really MIN-reduce ----------------------------------------


class FakeTensor(list[int]):
    def tolist(self) -> list[int]:
        return list(self)


class SharedGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[list[int]] = [[] for _ in range(size)]
        self.barrier = threading.Barrier(size, timeout=WAIT_S)
        self.calls = 0

    def handle(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(shared=self, rank=rank)

    def reduce(self, rank: int, tensor: FakeTensor, op: str) -> None:
        assert op == "min"
        self.slots[rank] = list(tensor)
        self.barrier.wait()
        result = [min(col) for col in zip(*self.slots, strict=True)]
        self.barrier.wait()
        if rank == 0:
            self.calls += 1
        tensor[:] = result


DIST = SimpleNamespace(
    get_world_size=lambda group: group.shared.size,
    all_reduce=lambda tensor, op, group: group.shared.reduce(group.rank, tensor, op),
    ReduceOp=SimpleNamespace(MIN="min", MAX="max"),
    ProcessGroup=object,
)


class Tensor:  # nothing here is a torch tensor
    pass


TORCH = SimpleNamespace(
    distributed=DIST,
    tensor=lambda flags, dtype, device: FakeTensor(flags),
    int32="int32",
    Tensor=Tensor,
)


class Env:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


# ---- the real code, compiled once per test (patches mutate classes and globals) -----------------


class FinishAbort:
    def __init__(self, message: str = "", status_code: Any = None) -> None:
        self.message = message
        self.status_code = status_code

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message}


class FinishLength:
    def __init__(self, length: int) -> None:
        self.length = length


@dataclass
class Chunk:  # TransferKVChunk's fields as add_transfer_request fills them
    room: int
    prefill_kv_indices: Any
    index_slice: slice
    is_last_chunk: bool
    prefill_aux_index: Any
    state_indices: Any
    num_kv_tokens: Any
    trace_ctx: Any
    wait_event: Any
    indices_event: Any
    staging_counted: bool = False


def null_trace() -> SimpleNamespace:
    return SimpleNamespace(
        abort=lambda **kw: None,
        trace_req_finish=lambda: None,
        copy_for_thread=lambda: None,
    )


def build_classes(freed: list[tuple[int, str]]) -> SimpleNamespace:
    """Compile the real classes; ``freed`` records every real page release (rank, rid)."""
    base_ns: dict[str, Any] = {}
    kvpoll = compile_from(DISAGG / "base/conn.py", base_ns, cls="KVPoll", whole=True)
    log = logging.getLogger("sglang-real")
    log.warning_once = log.warning  # type: ignore[attr-defined]

    utils_ns: dict[str, Any] = {
        "dist": DIST,
        "torch": TORCH,
        "envs": SimpleNamespace(SGLANG_TEST_DISAGG_FAILURE_PROB=Env(0.0)),
        "KVPoll": kvpoll,
        "List": list,
    }
    compile_from(
        DISAGG / "utils.py",
        utils_ns,
        names=(
            "all_reduce_flags",
            "_all_reduce_polls",
            "poll_and_all_reduce",
            "poll_and_all_reduce_attn_cp_tp_group",
            "_poll_with_failure_injection",
        ),
    )

    conn_ns: dict[str, Any] = {"KVPoll": kvpoll, "logger": log, "time": time}
    compile_from(DISAGG / "common/conn.py", conn_ns, cls="KVTransferError", whole=True)
    common_mgr = compile_from(
        DISAGG / "common/conn.py",
        conn_ns,
        cls="CommonKVManager",
        as_name="RealCommonMgr",
        names=(
            "check_status",
            "update_status",
            "record_failure",
            "conclude_transfer",
            "conclude_failure",
            "_maybe_ack_drained_abort",
            "_send_abort_acks",
            "register_deferred_ack_target",
            "poison_deferred_ack_room",
        ),
    )
    sender_cls = compile_from(
        DISAGG / "common/conn.py",
        conn_ns,
        cls="CommonKVSender",
        as_name="RealSender",
        names=(
            "poll",
            "_poll_with_status",
            "_check_bootstrap_timeout",
            "clear",
            "failure_exception",
            "abort",
        ),
    )
    moon_ns: dict[str, Any] = {
        "KVPoll": kvpoll,
        "logger": log,
        "time": time,
        "torch": TORCH,
        "NetworkAddress": lambda host, port: SimpleNamespace(
            to_host_port_str=lambda: f"{host}:{port}"
        ),
        "DisaggregationMode": SimpleNamespace(PREFILL="prefill"),
        "TransferKVChunk": Chunk,
        "TraceNullContext": null_trace,
    }
    moon_mgr = compile_from(
        DISAGG / "mooncake/conn.py",
        moon_ns,
        cls="MooncakeKVManager",
        as_name="RealMooncakeMgr",
        names=(
            "__init__",  # compiled for the start-up check only (Rank builds with __new__)
            "teardown",
            "transfer_worker",
            "_poison_unsettled_send",
            "add_transfer_request",
            "_handle_deferred_abort_notification",
        ),
    )
    mgr_cls = type("MooncakeKVManager", (moon_mgr, common_mgr), {})

    def release_kv_cache(req: Any, tree_cache: Any, *, checkpoint: bool) -> None:
        freed.append((tree_cache.rank, req.rid))
        req.kv.holds_kv = False

    def prepare_abort(req: Any, message: str, status_code: Any = None) -> None:
        req.finished_reason = FinishAbort(message, status_code)

    def checkpoint_kv_cache(req: Any, tree_cache: Any) -> None:
        req.checkpointed = True

    prefill_ns: dict[str, Any] = {
        "KVPoll": kvpoll,
        "logger": log,
        "scheduler_stage_method": lambda stage: lambda fn: fn,
        "SCHEDULER_STAGE_PROCESS_QUEUE": "process_queue",
        "poll_and_all_reduce_attn_cp_tp_group": utils_ns["poll_and_all_reduce_attn_cp_tp_group"],
        "release_kv_cache": release_kv_cache,
        "prepare_abort": prepare_abort,
        "get_parallel": lambda: SimpleNamespace(tp_rank=0, pp_rank=0),
        "get_disagg": lambda: SimpleNamespace(
            disaggregation_decode_allocation_policy="x", optimistic_prefill_attempts=3
        ),
        "envs": SimpleNamespace(SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=Env(True)),
        "should_force_retry": lambda req: False,
        "_uses_write_through_cache": lambda cache: False,
        "checkpoint_kv_cache": checkpoint_kv_cache,
        "array": array,
        "is_aborted": lambda req: isinstance(req.finished_reason, FinishAbort),
        "FINISH_ABORT": FinishAbort,
        "FINISH_LENGTH": FinishLength,
        "FAKE_BOOTSTRAP_HOST": "2.2.2.2",
        "CacheRequestOutcome": SimpleNamespace(SUCCESS="success", ABORT="abort"),
        "HTTPStatus": HTTPStatus,
    }
    compile_from(DISAGG / "prefill.py", prefill_ns, names=("maybe_release_metadata_buffer",))
    mixin = compile_from(
        DISAGG / "prefill.py",
        prefill_ns,
        cls="SchedulerDisaggregationPrefillMixin",
        names=(
            "process_disagg_prefill_inflight_queue",
            "handle_inflight_transfer_failure",
            "_retire_aborted_prefill_result",
            "clear_pending_chunk_send",
            "release_aborted_prefill_waiting_req",
            "optimistic_release_and_requeue",
            "handle_pending_bootstrap",
            "maybe_send_cached_prefix_chunk",
            # compiled for the start-up check only
            "process_batch_result_disagg_prefill",
            "process_prefill_chunk",
            "check_bootstrap",
        ),
    )
    sched_ns: dict[str, Any] = {
        "DisaggregationMode": SimpleNamespace(PREFILL="prefill", DECODE="decode", NULL="null"),
        "get_memory": lambda: None,
        "release_kv_cache": release_kv_cache,
        "prepare_abort": prepare_abort,
        "FINISH_ABORT": FinishAbort,
        "maybe_release_metadata_buffer": prefill_ns["maybe_release_metadata_buffer"],
        "_make_abort_req": lambda req, finished_reason=None: SimpleNamespace(rid=req.rid),
        "logger": log,
    }
    scheduler = compile_from(
        SRT / "managers/scheduler.py",
        sched_ns,
        cls="Scheduler",
        as_name="RealSchedulerIdle",
        names=(
            "is_fully_idle",
            "process_pending_chunked_abort",
            # compiled for the start-up check only
            "abort_request",
            "_get_new_batch_prefill_raw",
        ),
    )
    return SimpleNamespace(
        kvpoll=kvpoll,
        mgr_cls=mgr_cls,
        sender_cls=sender_cls,
        mixin=mixin,
        scheduler=type("Scheduler", (mixin, scheduler), {}),
        idle_cls=scheduler,
        prefill_ns=prefill_ns,
        sched_ns=sched_ns,
    )


class Gate:
    """Stands in for the transfer engine write: blocks until released, then returns ``rc``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.rc = 0
        self.sent = 0
        self.exc: BaseException | None = None  # what the write raises instead of returning

    def send(self, *args: Any, **kwargs: Any) -> int:
        self.sent += 1
        self.entered.set()
        assert self.proceed.wait(WAIT_S), "test never released the in-flight chunk"
        if self.exc is not None:
            raise self.exc
        return self.rc


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class Rank:
    """One prefill TP rank: real mooncake manager + worker thread, real sender, real scheduler."""

    def __init__(self, world: SimpleNamespace, rank: int, tp: SharedGroup) -> None:
        self.world, self.rank = world, rank
        self.gate = Gate()
        self.acks: list[tuple[int, Any]] = []
        self.mgr = self._make_mgr()
        self.worker = threading.Thread(
            target=self.mgr.transfer_worker,
            args=(self.mgr.transfer_queues[0], None),
            daemon=True,
        )  # unnamed, like MooncakeKVManager.__init__ starts them: "Thread-N (transfer_worker)"
        self.worker.start()
        self.mgr._worker_threads = [self.worker]
        self.sched = self._make_scheduler(tp)

    def _make_mgr(self) -> Any:
        mgr = self.world.cls.mgr_cls.__new__(self.world.cls.mgr_cls)
        mgr.__dict__.update(
            _stopped=False,
            _worker_threads=[],
            defer_decode_allocation=False,
            disaggregation_mode="prefill",
            request_status={},
            _staging_outstanding=defaultdict(int),
            _deferred_ack_targets={},
            _deferred_ack_poisoned_rooms=set(),
            failure_records={},
            failure_lock=threading.Lock(),
            deferred_bootstrap=None,
            enable_deferred_decode_kv_release=True,
            supports_deferred_decode_kv_release=True,
            enable_trace=False,
            enable_staging=False,
            _staging_ctx=None,
            transfer_infos={},
            req_to_decode_prefix_len={},
            transfer_queues=[queue.Queue()],
            session_lock=threading.Lock(),
            session_failures=defaultdict(int),
            state_layout_rejections={},
            failed_sessions=set(),
            failed_session_probes={},
            decode_kv_args_table={
                "decode:7000": SimpleNamespace(
                    requires_dcp_relayout=False,
                    dst_kv_ptrs=[0],
                    dst_tp_rank=0,
                    dst_attn_tp_size=1,
                    dst_kv_item_len=1,
                    dst_kv_layer_ids=None,
                    dst_aux_ptrs=[0],
                )
            },
            kv_args=SimpleNamespace(kv_data_ptrs=[1]),
            is_mla_backend=True,
            is_hybrid_mla_backend=False,
            attn_tp_size=1,
            bootstrap_port=0,
        )
        mgr.send_kvcache = self.gate.send
        mgr.send_aux = lambda req, idx, ptrs: 0
        mgr._get_dsa_cache_transfer_skip_flags = lambda info: (False, False)
        mgr._room_notify_targets = lambda room: []
        mgr.send_kv_status_message = lambda **kw: None
        mgr._send_abort_ack = lambda room, target: self.acks.append((room, target))
        return mgr

    def _make_scheduler(self, tp: SharedGroup) -> Any:
        sched = self.world.cls.scheduler.__new__(self.world.cls.scheduler)
        sched.__dict__.update(
            disagg_prefill_inflight_queue=[],
            disagg_prefill_pending_chunk_rids=set(),
            attn_tp_cpu_group=tp.handle(self.rank),
            attn_cp_cpu_group=SharedGroup(1).handle(0),
            tree_cache=SimpleNamespace(rank=self.rank, finish=lambda handle, outcome: None),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            output_streamer=SimpleNamespace(stream_output=lambda *a, **kw: None),
            req_to_metadata_buffer_idx_allocator=SimpleNamespace(free=lambda idx: None),
            disagg_prefill_bootstrap_queue=SimpleNamespace(
                pp_size=self.world.pp_size, kv_manager=self.mgr, queue=[]
            ),
            _release_aborted_request=lambda req: None,
            _pending_chunked_abort_req=None,
            send_abort_output=lambda out, req: None,
            req_to_token_pool=SimpleNamespace(available_size=lambda: 1),
            token_to_kv_pool_allocator=SimpleNamespace(page_size=4),
            enable_staging=False,
            processed_tokens_counter=0,
            # what the real is_fully_idle reads
            running_batch=SimpleNamespace(is_empty=lambda: True),
            chunked_req=None,
            dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False),
            last_batch=None,
            enable_overlap=False,
            _pp_microbatches_drained=lambda: True,
            waiting_queue=[],
            grammar_manager=SimpleNamespace(grammar_queue=[]),
            disaggregation_mode="prefill",
            enable_hisparse=False,
            enable_hierarchical_cache=False,
            enable_lmcache=False,
            _engine_paused=False,
        )
        return sched

    def start_room(self, room: int, *, bootstrapped: bool = True) -> Any:
        """Bootstrap a room and return its prefill request (real sender, in the inflight queue);
        ``bootstrapped=False``: decode has not answered yet (an optimistic prefill, parked)."""
        mgr = self.mgr
        mgr.update_status(room, self.world.cls.kvpoll.Bootstrapping)
        if bootstrapped:
            mgr.update_status(room, self.world.cls.kvpoll.WaitingForInput)
        mgr.transfer_infos[room] = {
            "decode:7000": SimpleNamespace(
                is_dummy=False,
                mooncake_session_id="decode:7000",
                dst_kv_indices=list(range(64)),
                dst_device_kv_indices=None,
                endpoint="decode",
                dst_port=7001,
                required_dst_info_num=1,
                room=room,
                decode_prefix_len=0,
            )
        }
        sender = self.world.cls.sender_cls.__new__(self.world.cls.sender_cls)
        sender.__dict__.update(
            bootstrap_room=room,
            kv_mgr=mgr,
            conclude_state=None,
            trace_ctx=null_trace(),
            _owns_bootstrap_room=True,
            _transfer_start_time=None,
            _prefill_complete_time=None,
            init_time=None,
            curr_idx=0,
        )
        req = SimpleNamespace(
            rid=f"r{room}",
            bootstrap_room=room,
            bootstrap_host="prefill",
            disagg_kv_sender=sender,
            finished_reason=None,
            to_finish=None,
            finished=lambda: True,
            return_routed_experts=False,
            return_logprob=False,
            pending_bootstrap=not bootstrapped,
            metadata_buffer_index=-1,
            cache_request_handle=None,
            kv=SimpleNamespace(holds_kv=True, holds_mamba=False, cache_protected_len=0),
            discard_output_reason=None,
            time_stats=SimpleNamespace(
                trace_ctx=null_trace(),
                set_completion_time=lambda: None,
                reset_prefill_retry_time=lambda: None,
                set_wait_queue_entry_time=lambda: None,
            ),
            # what optimistic_release_and_requeue touches
            skip_radix_cache_insert=True,
            reset_for_retract=lambda: None,
            advance_cache_request_handle=lambda: None,
            prefill_attempt_count=1,
            # what maybe_send_cached_prefix_chunk reads
            early_send_prefix_end=None,
            prefix_len=8,
            host_hit_length=0,
            start_send_idx=0,
        )
        self.sched.disagg_prefill_inflight_queue.append(req)
        return req

    def send_chunk(self, room: int, first: int, last: bool = False) -> None:
        """The scheduler's send_kv_chunk: real add_transfer_request onto the worker's queue."""
        self.mgr.add_transfer_request(
            room,
            list(range(first, first + 4)),
            slice(first, first + 4),
            last,
            aux_index=0 if last else None,
        )

    def abort_from_decode(self, room: int) -> None:
        """Decode's ABORT arriving on the bootstrap thread (real handler, deferred-ack mode)."""
        target = SimpleNamespace(ip="decode", port=7002, generation=1)
        notice = SimpleNamespace(room=room, deferred_ack_target=lambda: target)
        active = self.mgr.request_status.get(room) not in (None, self.world.cls.kvpoll.Success)
        self.mgr._handle_deferred_abort_notification(notice, active)

    def drained(self, room: int) -> bool:
        return (
            self.mgr.transfer_queues[0].empty() and self.mgr._staging_outstanding.get(room, 0) == 0
        )

    def stop(self) -> None:
        self.gate.proceed.set()
        self.mgr.transfer_queues[0].put(None)
        self.worker.join(WAIT_S)


@pytest.fixture
def make_world() -> Any:
    ranks: list[Rank] = []

    def make(tp_size: int = 1, pp_size: int = 1) -> SimpleNamespace:
        freed: list[tuple[int, str]] = []
        world = SimpleNamespace(cls=build_classes(freed), freed=freed, pp_size=pp_size)
        world.registry = CollectorRegistry()
        world.now = 0.0
        world.patch = None
        if not UNPATCHED:
            world.patch = prefill_pin.install_prefill_pin(
                prefill_pin.PrefillTargets(
                    mixin=world.cls.mixin,
                    scheduler=world.cls.idle_cls,
                    sender_mgr=world.cls.mgr_cls,
                ),
                metrics=KvFenceMetrics(world.registry),
                poisoned_budget_rooms=0,
                overdue_after_s=60.0,
                clock=lambda: world.now,
            )
        tp = SharedGroup(tp_size)
        world.tp = tp
        world.ranks = [Rank(world, r, tp) for r in range(tp_size)]
        ranks.extend(world.ranks)
        return world

    yield make
    for rank in ranks:
        rank.stop()


def process_all(world: SimpleNamespace) -> None:
    """One scheduler pass on every rank at once (the reductions are collectives)."""
    if len(world.ranks) == 1:
        world.ranks[0].sched.process_disagg_prefill_inflight_queue()
        return
    with ThreadPoolExecutor(len(world.ranks)) as pool:
        futures = [pool.submit(r.sched.process_disagg_prefill_inflight_queue) for r in world.ranks]
        for f in futures:
            f.result(timeout=WAIT_S)


def test_abort_with_chunk_in_flight_pins_pages_until_the_chunk_completes(make_world: Any) -> None:
    """guards: decode aborts while the worker is writing a chunk of the room; the real failure
    path must not free the source pages until that chunk returned (the queued one is skipped)."""
    world = make_world()
    rank = world.ranks[0]
    req = rank.start_room(41)
    rank.send_chunk(41, 0)
    assert rank.gate.entered.wait(WAIT_S)  # chunk 1 is being written
    rank.send_chunk(41, 4)  # chunk 2 queued behind it
    rank.abort_from_decode(41)
    process_all(world)  # Failed poll -> handle_inflight_transfer_failure
    assert isinstance(req.finished_reason, FinishAbort)
    assert rank.sched.disagg_prefill_inflight_queue == []
    assert world.freed == [], "pages freed while a chunk is still reading them"
    assert not rank.sched.is_fully_idle()  # the idle leak check must not count them
    assert rank.sched.is_fully_idle(for_health_check=True)
    process_all(world)
    assert world.freed == []
    rank.gate.proceed.set()  # the write returns
    wait_for(lambda: rank.drained(41), "the worker to drain room 41")
    assert rank.gate.sent == 1  # the queued chunk was skipped, never written
    assert rank.acks and rank.acks[0][0] == 41  # upstream's drained ack went out
    process_all(world)
    assert world.freed == [(0, "r41")]
    assert prefill_pin.pinned_sources(rank.sched) == []
    assert rank.sched.is_fully_idle()
    assert world.registry.get_sample_value("cas_kv_pinned_source_rooms") == 0


def test_local_abort_with_chunk_in_flight_pins_pages(make_world: Any) -> None:
    """guards: a local abort (client gone) retires the request through
    _retire_aborted_prefill_result; same rule: pages wait for the in-flight chunk."""
    world = make_world()
    rank = world.ranks[0]
    req = rank.start_room(42)
    rank.send_chunk(42, 0)
    assert rank.gate.entered.wait(WAIT_S)
    rank.sched.disagg_prefill_inflight_queue.clear()  # still in the running batch, not inflight
    assert rank.sched._retire_aborted_prefill_result(req) is True
    assert world.freed == []
    # a later result of the same request (overlap scheduling): already retired, as upstream
    # answers once the KV is released; it must not be streamed or released twice
    assert rank.sched._retire_aborted_prefill_result(req) is False
    process_all(world)
    assert world.freed == []
    rank.gate.proceed.set()
    wait_for(lambda: rank.drained(42), "the worker to drain room 42")
    process_all(world)
    assert world.freed == [(0, "r42")]


def test_poisoned_transfer_stays_pinned_and_is_counted(make_world: Any) -> None:
    """guards: a send that failed or timed out may still be reading the pages (the batch can
    outlive batch_transfer_sync); the room is never released by a drain and never acks."""
    world = make_world()
    rank = world.ranks[0]
    rank.start_room(43)
    rank.gate.rc = -1
    rank.send_chunk(43, 0)
    assert rank.gate.entered.wait(WAIT_S)
    rank.gate.proceed.set()
    wait_for(lambda: rank.drained(43), "the failed send to return")
    assert 43 in rank.mgr._deferred_ack_poisoned_rooms
    rank.abort_from_decode(43)  # decode's abort after the poison: no ack may go out
    for _ in range(3):
        process_all(world)
    assert world.freed == []
    assert rank.acks == []
    pins = prefill_pin.pinned_sources(rank.sched)
    assert len(pins) == 1 and pins[0].poisoned
    assert world.registry.get_sample_value("cas_kv_poisoned_transfers_total") == 1
    assert world.registry.get_sample_value("cas_kv_poisoned_source_rooms") == 1
    assert world.registry.get_sample_value("cas_kv_pinned_source_rooms") == 1
    assert world.registry.get_sample_value("cas_kv_unhealthy_by_quarantine") == 1
    assert world.patch.health()[0] is False


def test_tp_ranks_release_together_only_when_every_sender_drained(make_world: Any) -> None:
    """guards: polls are MIN-reduced, so the hold must be too: rank 0 drained, rank 1 still
    writing -> neither rank frees; rank 1 drains -> both free in the same pass."""
    world = make_world(tp_size=2)
    r0, r1 = world.ranks
    for r in world.ranks:
        r.start_room(44)
        r.send_chunk(44, 0)
        assert r.gate.entered.wait(WAIT_S)
        r.abort_from_decode(44)
    r0.gate.proceed.set()
    wait_for(lambda: r0.drained(44), "rank 0 to drain")
    process_all(world)
    process_all(world)
    assert world.freed == [], "a rank freed pages while a peer rank's chunk is in flight"
    r1.gate.proceed.set()
    wait_for(lambda: r1.drained(44), "rank 1 to drain")
    calls = world.tp.calls
    process_all(world)
    assert sorted(world.freed) == [(0, "r44"), (1, "r44")]
    assert world.tp.calls == calls + 1  # one pin reduction per pass (inflight queue empty)


def test_pipeline_parallel_falls_back_to_upstream(make_world: Any) -> None:
    """With pp_size > 1 stages resolve at different steps; the patch must not pin there."""
    world = make_world(pp_size=2)
    rank = world.ranks[0]
    rank.start_room(45)
    rank.send_chunk(45, 0)
    assert rank.gate.entered.wait(WAIT_S)
    rank.abort_from_decode(45)
    process_all(world)
    assert world.freed == [(0, "r45")]


def test_refuses_deferred_release_off(make_world: Any) -> None:
    """Without deferred release a failed send is not marked poisoned: refuse to run."""
    if UNPATCHED:
        pytest.skip("checks the patch itself")
    world = make_world()
    world.ranks[0].mgr.enable_deferred_decode_kv_release = False
    with pytest.raises(StrictReclaimError, match="DEFERRED_DECODE_KV_RELEASE=1"):
        process_all(world)


def test_check_covers_every_patched_function() -> None:
    """The start-up check must refuse a changed or missing target, and pass the real ones."""
    cls = build_classes([])
    targets = prefill_pin.PrefillTargets(cls.mixin, cls.idle_cls, cls.mgr_cls)
    prefill_pin.check_prefill_targets(targets)

    class ChangedMixin(cls.mixin):  # type: ignore[misc,name-defined]
        def handle_inflight_transfer_failure(self, req: Any) -> None:
            return None

    ChangedMixin.process_disagg_prefill_inflight_queue = (
        cls.mixin.process_disagg_prefill_inflight_queue
    )
    ChangedMixin._retire_aborted_prefill_result = cls.mixin._retire_aborted_prefill_result
    with pytest.raises(StrictReclaimError, match="no longer contains"):
        prefill_pin.check_prefill_targets(
            prefill_pin.PrefillTargets(ChangedMixin, None, cls.mgr_cls)
        )

    class NoWorker:
        pass

    with pytest.raises(StrictReclaimError, match="transfer_worker is missing"):
        prefill_pin.check_prefill_targets(prefill_pin.PrefillTargets(cls.mixin, None, NoWorker))

    class IdleChanged:
        def is_fully_idle(self) -> bool:
            return True

    with pytest.raises(StrictReclaimError, match="is_fully_idle no longer contains"):
        prefill_pin.check_prefill_targets(
            prefill_pin.PrefillTargets(cls.mixin, IdleChanged, cls.mgr_cls)
        )
    del cls.prefill_ns["poll_and_all_reduce_attn_cp_tp_group"]
    with pytest.raises(StrictReclaimError, match="poll_and_all_reduce_attn_cp_tp_group"):
        prefill_pin.check_prefill_targets(targets)


def test_install_is_idempotent() -> None:
    if UNPATCHED:
        pytest.skip("checks the patch itself")
    cls = build_classes([])
    targets = prefill_pin.PrefillTargets(cls.mixin, cls.idle_cls, cls.mgr_cls)
    first = prefill_pin.install_prefill_pin(targets)
    release = cls.prefill_ns["release_kv_cache"]
    assert prefill_pin.install_prefill_pin(targets) is first
    assert cls.prefill_ns["release_kv_cache"] is release


def test_loading_the_real_modules_fails_with_a_clear_reason_or_works() -> None:
    try:
        targets = prefill_pin.load_prefill_targets()
    except StrictReclaimError as exc:
        assert "cannot import sglang.srt" in str(exc) and "No module named" in str(exc)
    else:
        prefill_pin.check_prefill_targets(targets)


def test_poison_on_one_rank_pins_the_room_on_every_rank(make_world: Any) -> None:
    """guards: rank 1's send failed (poisoned), rank 0's succeeded and drained: the group must
    agree on "pinned for good" on both ranks, not free on rank 0 alone."""
    world = make_world(tp_size=2)
    r0, r1 = world.ranks
    r1.gate.rc = -1
    for r in world.ranks:
        r.start_room(46)
        r.send_chunk(46, 0)
        assert r.gate.entered.wait(WAIT_S)
        r.gate.proceed.set()
        wait_for(lambda r=r: r.drained(46), f"rank {r.rank} to drain")
    assert 46 in r1.mgr._deferred_ack_poisoned_rooms
    assert 46 not in r0.mgr._deferred_ack_poisoned_rooms
    r0.abort_from_decode(46)  # rank 0's room must fail too; rank 1 failed on its own
    for _ in range(2):
        process_all(world)
    assert world.freed == []
    for r in world.ranks:
        pins = prefill_pin.pinned_sources(r.sched)
        assert len(pins) == 1 and pins[0].poisoned


def sample(world: SimpleNamespace, name: str, **labels: str) -> float | None:
    return world.registry.get_sample_value(name, labels or None)


def test_chunked_abort_with_chunk_in_flight_pins_pages(make_world: Any) -> None:
    """guards: a client abort of the request being chunk-prefilled is run by the real
    Scheduler.process_pending_chunked_abort (scheduler.py:3778) at the start of the next step;
    an earlier chunk of it may still be in the worker, so its pages wait for that chunk."""
    world = make_world()
    rank = world.ranks[0]
    sched = rank.sched
    req = rank.start_room(47)
    sched.disagg_prefill_inflight_queue.clear()  # still chunking: not in the inflight queue
    rank.send_chunk(47, 0)  # a middle chunk (process_prefill_chunk's send_kv_chunk)
    assert rank.gate.entered.wait(WAIT_S)
    rank.send_chunk(47, 4)  # the next one, queued behind it
    sched.chunked_req = req
    sched._pending_chunked_abort_req = req  # what abort_request records (scheduler.py:5678)
    sched.process_pending_chunked_abort()
    assert sched.chunked_req is None and sched._pending_chunked_abort_req is None
    assert isinstance(req.finished_reason, FinishAbort)
    assert world.freed == [], "pages freed while a chunk of the aborted chunked request is read"
    assert not sched.is_fully_idle()
    # overlap: the in-flight chunk's result comes back (prefill.py:1090-1091): already retired
    assert sched._retire_aborted_prefill_result(req) is False
    process_all(world)
    assert world.freed == []
    rank.gate.proceed.set()
    wait_for(lambda: rank.drained(47), "the worker to drain room 47")
    assert rank.gate.sent == 1  # sender.abort() made the worker skip the queued chunk
    process_all(world)
    assert world.freed == [(0, "r47")]
    assert prefill_pin.pinned_sources(sched) == []
    assert sched.is_fully_idle()


def test_chunked_abort_outside_prefill_mode_is_untouched(make_world: Any) -> None:
    """Pins are resolved by the prefill inflight pass only; another mode must free at once."""
    world = make_world()
    rank = world.ranks[0]
    sched = rank.sched
    req = rank.start_room(55)
    sched.disagg_prefill_inflight_queue.clear()
    sched.disaggregation_mode = "null"
    sched.chunked_req = sched._pending_chunked_abort_req = req
    sched.process_pending_chunked_abort()
    assert world.freed == [(0, "r55")]
    assert prefill_pin.pinned_sources(sched) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_transfer_worker_dying_with_a_chunk_counted_pins_for_good(make_world: Any) -> None:
    """guards: the worker's Exception handler poisons the room of the chunk it held and ends
    the thread (mooncake/conn.py:2878-2884); the count is never decremented. The pin must not
    wait for it forever uncounted: it is pinned for good and counted, and the budget trips."""
    world = make_world()
    rank = world.ranks[0]
    rank.start_room(48)
    rank.gate.exc = ValueError("transport bug")
    rank.send_chunk(48, 0)
    assert rank.gate.entered.wait(WAIT_S)
    rank.gate.proceed.set()
    rank.worker.join(WAIT_S)
    assert not rank.worker.is_alive()
    assert rank.mgr._staging_outstanding.get(48) == 1  # counted, never decremented
    assert 48 in rank.mgr._deferred_ack_poisoned_rooms
    rank.abort_from_decode(48)
    for _ in range(2):
        process_all(world)
    assert world.freed == []
    pins = prefill_pin.pinned_sources(rank.sched)
    assert len(pins) == 1 and pins[0].poisoned, "a dead worker's room held uncounted"
    assert sample(world, "cas_kv_poisoned_source_rooms") == 1
    assert sample(world, "cas_kv_unhealthy_by_quarantine") == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_transfer_worker_ending_without_poison_counts_as_poisoned(make_world: Any) -> None:
    """guards: a worker ended by a BaseException skips upstream's handler, so nothing is
    poisoned and the count stays. A dead transfer worker (not torn down) with a counted chunk
    is treated as poisoned; a torn-down manager's ended workers are not evidence."""
    world = make_world()
    rank = world.ranks[0]
    rank.start_room(49)
    rank.gate.exc = SystemExit()  # threading ends the thread silently
    rank.send_chunk(49, 0)
    assert rank.gate.entered.wait(WAIT_S)
    rank.gate.proceed.set()
    rank.worker.join(WAIT_S)
    assert not rank.worker.is_alive()
    assert rank.worker.name.endswith(prefill_pin.WORKER_NAME_SUFFIX)
    assert rank.mgr._staging_outstanding.get(49) == 1
    assert 49 not in rank.mgr._deferred_ack_poisoned_rooms
    rank.abort_from_decode(49)
    rank.mgr._stopped = True  # as teardown() sets it (a role switch)
    process_all(world)
    assert world.freed == []
    pins = prefill_pin.pinned_sources(rank.sched)
    assert len(pins) == 1 and not pins[0].poisoned  # held, not yet judged
    rank.mgr._stopped = False
    process_all(world)
    assert world.freed == []
    assert pins[0].poisoned and pins[0].dead_worker
    assert sample(world, "cas_kv_poisoned_source_rooms") == 1


def test_a_long_hold_is_counted_overdue(make_world: Any) -> None:
    """A chunk that never returns (a hung send) keeps its pages pinned; it must be visible."""
    if UNPATCHED:
        pytest.skip("checks the patch itself")
    world = make_world()
    rank = world.ranks[0]
    rank.start_room(50)
    rank.send_chunk(50, 0)
    assert rank.gate.entered.wait(WAIT_S)
    rank.abort_from_decode(50)
    process_all(world)
    assert sample(world, "cas_kv_overdue_source_pins") == 0
    world.now = 61.0
    process_all(world)
    assert sample(world, "cas_kv_overdue_source_pins") == 1
    assert world.freed == []
    rank.gate.proceed.set()
    wait_for(lambda: rank.drained(50), "the worker to drain room 50")
    process_all(world)
    assert world.freed == [(0, "r50")]
    assert sample(world, "cas_kv_overdue_source_pins") == 0


def record_sends(sched: Any) -> list[tuple[str, bool, Any]]:
    sent: list[tuple[str, bool, Any]] = []

    def send_kv_chunk(req: Any, last_chunk: bool = False, end_idx: Any = None) -> None:
        sent.append((req.rid, last_chunk, end_idx))

    sched.send_kv_chunk = send_kv_chunk
    return sent


def test_optimistic_requeue_frees_a_request_that_never_sent(make_world: Any) -> None:
    """safe (module docstring (A)): a parked optimistic request (prefill done, decode not yet
    bootstrapped) yields its slot through the real process_disagg_prefill_inflight_queue and
    optimistic_release_and_requeue (prefill.py:1214). The real early send skips a pending
    request and the parked branch sends only once bootstrapped, so nothing of it was ever
    queued: upstream's immediate free stands, and the same req is requeued unpinned."""
    world = make_world()
    rank = world.ranks[0]
    sched = rank.sched
    sent = record_sends(sched)
    bootstrapped = rank.start_room(52)
    sched.maybe_send_cached_prefix_chunk(bootstrapped)  # the gate below is not vacuous
    assert sent == [("r52", False, 8)]
    sched.disagg_prefill_inflight_queue.remove(bootstrapped)
    sent.clear()
    req = rank.start_room(51, bootstrapped=False)
    sched.maybe_send_cached_prefix_chunk(req)  # run_batch's early send (scheduler.py:4654)
    assert sent == []
    sched.req_to_token_pool = SimpleNamespace(available_size=lambda: 0)
    sched.waiting_queue = [SimpleNamespace(rid="queued")]
    process_all(world)  # Bootstrapping poll, no free slot, work waiting: yield
    assert sched.waiting_queue[0] is req and req.pending_bootstrap
    assert req.prefill_attempt_count == 2
    assert world.freed == [(0, "r51")]
    assert prefill_pin.pinned_sources(sched) == []
    assert sent == [] and rank.mgr.transfer_queues[0].empty() and rank.gate.sent == 0
    if UNPATCHED:
        return
    path = prefill_pin.OPTIMISTIC_REQUEUE
    assert sample(world, "cas_kv_unpinned_source_frees_total", path=path) == 0
    # tripwire: a request whose sender had sent something is counted (never expected)
    other = rank.start_room(56, bootstrapped=False)
    sched.disagg_prefill_inflight_queue.remove(other)
    other.disagg_kv_sender.curr_idx = 4
    sched.optimistic_release_and_requeue(other)
    assert sample(world, "cas_kv_unpinned_source_frees_total", path=path) == 1


def test_waiting_queue_abort_frees_a_request_that_never_sent(make_world: Any) -> None:
    """safe (module docstring (B)): abort_request's waiting-queue branch calls the real
    release_aborted_prefill_waiting_req (scheduler.py:5714); a waiting request never had a
    chunk queued, so the immediate free stands. Its sender is aborted (room Failed)."""
    world = make_world()
    rank = world.ranks[0]
    sched = rank.sched
    req = rank.start_room(53)  # popped from the bootstrap queue, bootstrapped, not admitted
    sched.disagg_prefill_inflight_queue.clear()
    sched.release_aborted_prefill_waiting_req(req)
    assert world.freed == [(0, "r53")]
    assert rank.mgr.request_status[53] == world.cls.kvpoll.Failed
    assert prefill_pin.pinned_sources(sched) == []
    if UNPATCHED:
        return
    path = prefill_pin.WAITING_ABORT
    assert sample(world, "cas_kv_unpinned_source_frees_total", path=path) == 0
    other = rank.start_room(54)
    sched.disagg_prefill_inflight_queue.clear()
    rank.send_chunk(54, 0)  # never happens to a waiting request; the tripwire must see it
    assert rank.gate.entered.wait(WAIT_S)
    sched.release_aborted_prefill_waiting_req(other)
    assert sample(world, "cas_kv_unpinned_source_frees_total", path=path) == 1
    rank.gate.proceed.set()


# ---- the source conditions that make the two unpinned paths safe -------------------------------


@functools.cache
def _srt_texts() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(SRT.rglob("*.py"))}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(_srt_texts()[path])


def _calls(path: Path, attr: str) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """Each call ``<x>.<attr>(...)`` in ``path``: its function, line and guards (the tests of
    the enclosing ifs with the branch taken, and earlier ``if ...: return`` in the same body)."""
    found: list[tuple[str, int, list[tuple[str, str]]]] = []

    def body(stmts: list[ast.stmt], func: str, guards: list[tuple[str, str]]) -> None:
        guards = list(guards)
        for stmt in stmts:
            walk(stmt, func, guards)
            if (
                isinstance(stmt, ast.If)
                and not stmt.orelse
                and len(stmt.body) == 1
                and isinstance(stmt.body[0], ast.Return)
            ):
                guards.append((ast.unparse(stmt.test), "return"))

    def walk(node: ast.AST, func: str, guards: list[tuple[str, str]]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func, guards = node.name, []
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            walk(node.test, func, guards)
            body(node.body, func, [*guards, (test, "if")])
            body(node.orelse, func, [*guards, (test, "else")])
            return
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == attr
        ):
            found.append((func, node.lineno, guards))
        for _name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                body(value, func, guards)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        walk(item, func, guards)
            elif isinstance(value, ast.AST):
                walk(value, func, guards)

    walk(_tree(path), "<module>", [])
    return found


def _callers(attr: str) -> dict[tuple[str, str], list[list[tuple[str, str]]]]:
    """Every call of ``.<attr>(`` in sglang/srt, by (file, function), in source order."""
    out: dict[tuple[str, str], list[list[tuple[str, str]]]] = {}
    for path, text in _srt_texts().items():
        if f".{attr}(" not in text:
            continue
        for func, _line, guards in _calls(path, attr):
            out.setdefault((str(path.relative_to(SRT)), func), []).append(guards)
    return out


def _assert_guarded(
    attr: str, expected: dict[tuple[str, str], list[tuple[str, str]]], why: str
) -> None:
    callers = _callers(attr)
    assert set(callers) == set(expected), f"{attr} callers changed ({why}): {sorted(callers)}"
    for key, guard_lists in callers.items():
        assert len(guard_lists) == len(expected[key]), f"{key} calls {attr} differently"
        for guards, needed in zip(guard_lists, expected[key], strict=True):
            assert needed in guards, f"{key}: {attr} no longer behind {needed} ({why})"


PF = "disaggregation/prefill.py"
SCHED = "managers/scheduler.py"


def test_safe_paths_rest_on_the_installed_source() -> None:
    """The unpinned paths are safe only while (A) and (B) of prefill_pin's docstring hold: a
    change to any guard, call site or queue entry below must fail here (re-check the reasoning).
    """
    # (A) chunks reach the worker only through send_kv_chunk -> _send_kv_chunk -> sender.send ->
    # kv_mgr.add_transfer_request, and every send_kv_chunk runs with pending_bootstrap False
    assert set(_callers("add_transfer_request")) == {("disaggregation/common/conn.py", "send")}
    assert set(_callers("_send_kv_chunk")) == {(PF, "send_kv_chunk")}
    send_calls = [c for c in _calls(SRT / PF, "send") if c[0] != "<module>"]
    assert {func for func, _, _ in send_calls} == {"_send_kv_chunk"}
    assert not any("disagg_kv_sender.send(" in text for text in _srt_texts().values())
    _assert_guarded(
        "send_kv_chunk",
        {
            (PF, "process_batch_result_disagg_prefill"): [
                ("not req.pending_bootstrap", "if"),
                ("self.enable_overlap and (not req.pending_bootstrap)", "if"),
            ],
            (PF, "process_disagg_prefill_inflight_queue"): [
                ("self.handle_pending_bootstrap(req, poll)", "if")
            ],
            (PF, "process_prefill_chunk"): [("not self.check_bootstrap(req)", "else")],
            (PF, "maybe_send_cached_prefix_chunk"): [
                ("req.pending_bootstrap or not allow_send", "return")
            ],
        },
        "a chunk must only be queued once the request is bootstrapped",
    )
    # ... the helpers those guards rely on: True only once the flag is cleared
    mixin_src = _srt_texts()[SRT / PF]
    for line in (
        "        if not req.pending_bootstrap:\n            return True\n",  # check_bootstrap
        "            assert self.disagg_prefill_bootstrap_queue.finalize_bootstrap(req)\n"
        "            self.checkpoint_disagg_prefill(req)\n            return True\n",
        "        req.disagg_kv_sender.init(num_pages, req.metadata_buffer_index)\n"
        "        req.pending_bootstrap = False\n        return True\n",  # finalize_bootstrap
    ):
        assert line in mixin_src, line
    handle = next(
        n
        for n in ast.walk(_tree(SRT / PF))
        if isinstance(n, ast.FunctionDef) and n.name == "handle_pending_bootstrap"
    )
    returns_true = [
        n for n in ast.walk(handle) if isinstance(n, ast.Return) and ast.unparse(n) == "return True"
    ]
    assert len(returns_true) == 1  # only after finalize_bootstrap
    # the flag is set only by create_sender and optimistic_release_and_requeue
    set_true = set()
    for path, text in _srt_texts().items():
        if "pending_bootstrap = True" not in text:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef):
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.Assign)
                        and ast.unparse(sub.targets[0]).endswith(".pending_bootstrap")
                        and ast.unparse(sub.value) == "True"
                    ):
                        set_true.add((str(path.relative_to(SRT)), node.name))
    assert set_true == {(PF, "create_sender"), (PF, "optimistic_release_and_requeue")}
    # (A) optimistic_release_and_requeue runs only while the flag is still set
    _assert_guarded(
        "optimistic_release_and_requeue",
        {
            (PF, "process_batch_result_disagg_prefill"): [
                ("req.pending_bootstrap and should_force_retry(req)", "if"),
                ("req.pending_bootstrap and (not still_chunking)", "if"),
            ],
            (PF, "process_disagg_prefill_inflight_queue"): [("req.pending_bootstrap", "if")],
            (PF, "process_prefill_chunk"): [("not self.check_bootstrap(req)", "if")],
        },
        "a requeued request must never have sent a chunk",
    )
    # (B) the waiting queue: who adds to it on the prefill side, and its only abort path
    entrants: dict[tuple[str, str], list[str]] = {}
    for rel in (PF, SCHED):
        for method in ("append", "extend", "insert"):
            for func, line, guards in _calls(SRT / rel, method):
                src = ast.get_source_segment(
                    _srt_texts()[SRT / rel], _node_at(SRT / rel, line, method)
                )
                if src and src.startswith("self.waiting_queue."):
                    entrants.setdefault((rel, func), []).append(src)
                    if rel == SCHED:
                        assert (
                            "self.disaggregation_mode == DisaggregationMode.NULL",
                            "if",
                        ) in guards
    assert entrants == {
        (PF, "event_loop_normal_disagg_prefill"): [
            "self.waiting_queue.extend(\n"
            "                self.disagg_prefill_bootstrap_queue.pop_bootstrapped()\n"
            "            )"
        ],
        (PF, "event_loop_overlap_disagg_prefill"): ["self.waiting_queue.extend(bootstrapped_reqs)"],
        (PF, "optimistic_release_and_requeue"): ["self.waiting_queue.insert(0, req)"],
        (SCHED, "_add_request_to_queue"): ["self.waiting_queue.append(req)"],
    }
    assert "bootstrapped_reqs = self.disagg_prefill_bootstrap_queue.pop_bootstrapped()" in (
        mixin_src
    )
    # the bootstrap queue: new requests (a fresh sender, flag set) and exhausted requeues
    assert set(_callers("create_sender")) == {(PF, "add")}
    assert set(_callers("pop_bootstrapped")) == {
        (PF, "event_loop_normal_disagg_prefill"),
        (PF, "event_loop_overlap_disagg_prefill"),
        # the pipeline-parallel loop (pinning is off there); it too feeds the waiting queue
        ("managers/scheduler_pp_mixin.py", "process_bootstrapped_queue"),
    }
    assert set(_callers("release_aborted_prefill_waiting_req")) == {(SCHED, "abort_request")}
    # admission takes requests out of the waiting queue; the early send is for batch requests
    assert set(_callers("maybe_send_cached_prefix_chunk")) == {(SCHED, "run_batch")}
    sched_src = _srt_texts()[SRT / SCHED]
    assert (
        "            for req in batch.reqs:\n"
        "                self.maybe_send_cached_prefix_chunk(req, allow_send=not load_pending)\n"
    ) in sched_src
    assert (
        "self.waiting_queue = [x for x in self.waiting_queue if x not in can_run_set]" in sched_src
    )


def _node_at(path: Path, line: int, method: str) -> ast.AST:
    for node in ast.walk(_tree(path)):
        if (
            isinstance(node, ast.Call)
            and node.lineno == line
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == method
        ):
            return node
    raise AssertionError(f"no {method} call at {path}:{line}")


def test_check_refuses_a_changed_chunked_abort_or_a_missing_scheduler_release() -> None:
    cls = build_classes([])
    targets = prefill_pin.PrefillTargets(cls.mixin, cls.idle_cls, cls.mgr_cls)
    prefill_pin.check_prefill_targets(targets)

    class ChangedScheduler(cls.idle_cls):  # type: ignore[misc,name-defined]
        def process_pending_chunked_abort(self) -> None:
            return None

    for name in ("is_fully_idle", "abort_request", "_get_new_batch_prefill_raw"):
        setattr(ChangedScheduler, name, cls.idle_cls.__dict__[name])
    with pytest.raises(StrictReclaimError, match="process_pending_chunked_abort no longer"):
        prefill_pin.check_prefill_targets(
            prefill_pin.PrefillTargets(cls.mixin, ChangedScheduler, cls.mgr_cls)
        )
    del cls.sched_ns["release_kv_cache"]
    with pytest.raises(StrictReclaimError, match=r"scheduler\.py.*release_kv_cache|release_kv"):
        prefill_pin.check_prefill_targets(targets)
