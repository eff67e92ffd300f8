"""Prefill source-page pinning against the REAL SGLang 0.5.23 mooncake PD code.

The prefill modules import torch at module level, so, as in ``test_sglang_reclaim.py``, the real
functions are compiled straight from the installed sglang files (names and line numbers kept)
with stubs only for torch/the allocator/the network:

- scheduler side (``prefill.py``): ``process_disagg_prefill_inflight_queue``,
  ``handle_inflight_transfer_failure``, ``_retire_aborted_prefill_result``,
  ``clear_pending_chunk_send``, ``maybe_release_metadata_buffer``; ``Scheduler.is_fully_idle``;
- the poll reduction (``utils.py``): ``poll_and_all_reduce_attn_cp_tp_group`` and what it calls,
  over a thread-backed fake gloo group so two TP ranks really MIN-reduce;
- the mooncake sender (``mooncake/conn.py`` + ``common/conn.py``): ``transfer_worker`` running in
  a thread (chunk counting at dequeue, the Failed skip, ``_poison_unsettled_send``),
  ``add_transfer_request``, ``_handle_deferred_abort_notification`` (decode's ABORT),
  ``update_status``/``conclude_transfer``/``_maybe_ack_drained_abort``/``poison_deferred_ack_room``
  and ``CommonKVSender.poll``/``clear``/``failure_exception``/``abort``.

Only ``send_kvcache`` (the RDMA/TCP write) is a stub: it blocks on a gate, so a chunk is really
"in flight" in the worker while the scheduler handles the failure. ``CAS_TEST_UNPATCHED=1`` runs
the same tests on unpatched code; every test marked ``guards`` then fails (checked by hand).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import threading
import time
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
        names=("poll", "_poll_with_status", "clear", "failure_exception", "abort"),
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

    prefill_ns: dict[str, Any] = {
        "KVPoll": kvpoll,
        "logger": log,
        "scheduler_stage_method": lambda stage: lambda fn: fn,
        "SCHEDULER_STAGE_PROCESS_QUEUE": "process_queue",
        "poll_and_all_reduce_attn_cp_tp_group": utils_ns["poll_and_all_reduce_attn_cp_tp_group"],
        "release_kv_cache": release_kv_cache,
        "prepare_abort": prepare_abort,
        "get_parallel": lambda: SimpleNamespace(tp_rank=0, pp_rank=0),
        "get_disagg": lambda: SimpleNamespace(disaggregation_decode_allocation_policy="x"),
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
        ),
    )
    sched_ns: dict[str, Any] = {
        "DisaggregationMode": SimpleNamespace(PREFILL="prefill", DECODE="decode"),
        "get_memory": lambda: None,
    }
    scheduler = compile_from(
        SRT / "managers/scheduler.py",
        sched_ns,
        cls="Scheduler",
        as_name="RealSchedulerIdle",
        names=("is_fully_idle",),
    )
    return SimpleNamespace(
        kvpoll=kvpoll,
        mgr_cls=mgr_cls,
        sender_cls=sender_cls,
        mixin=mixin,
        scheduler=type("Scheduler", (mixin, scheduler), {}),
        idle_cls=scheduler,
        prefill_ns=prefill_ns,
    )


class Gate:
    """Stands in for the transfer engine write: blocks until released, then returns ``rc``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.rc = 0
        self.sent = 0

    def send(self, *args: Any, **kwargs: Any) -> int:
        self.sent += 1
        self.entered.set()
        assert self.proceed.wait(WAIT_S), "test never released the in-flight chunk"
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
        )
        self.worker.start()
        self.sched = self._make_scheduler(tp)

    def _make_mgr(self) -> Any:
        mgr = self.world.cls.mgr_cls()
        mgr.__dict__.update(
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

    def start_room(self, room: int) -> Any:
        """Bootstrap a room and return its prefill request (real sender, in the inflight queue)."""
        mgr = self.mgr
        mgr.update_status(room, self.world.cls.kvpoll.Bootstrapping)
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
            pending_bootstrap=False,
            metadata_buffer_index=-1,
            cache_request_handle=None,
            kv=SimpleNamespace(holds_kv=True, holds_mamba=False),
            time_stats=SimpleNamespace(trace_ctx=null_trace(), set_completion_time=lambda: None),
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
