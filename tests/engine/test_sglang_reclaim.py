"""Strict reclaim adapter against the REAL SGLang 0.5.23 decode code (cas_engine.sglang.reclaim).

``sglang.srt.disaggregation.decode`` cannot be imported on this CPU machine: it imports torch at
module level (and ``sglang/__init__`` pulls psutil and more). So the test compiles the real
methods of ``DecodeTransferQueue`` (``__init__``, ``_defer_release``,
``resolve_deferred_releases``, ``_do_release``, ``_release_request``, ``_is_host_destination``,
``_observe_deferred_kv_release``), the real abort-ack bookkeeping of ``CommonKVManager``
(``register_deferred_abort_room``, ``note_abort_ack``, ``is_abort_release_safe``,
``clear_deferred_abort_state``), its peer-failure handler (``_handle_node_failure`` with
``check_status``/``update_status``/``record_failure``) and the real ``all_reduce_flags`` straight
from the installed sglang source files (file names and line numbers kept), with stubs only for
what they import (torch.distributed, env accessors, the allocator). Everything the patch touches
runs as upstream wrote it. Skipped when sglang 0.5.23 is not installed. ``CAS_TEST_UNPATCHED=1``
runs the peer tests (docstrings start with "guards") without the patch: they must fail.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.kvfence import KvFenceMetrics
from cas_engine.kvfence.gone_feed import GonePrefill
from cas_engine.sglang import reclaim
from cas_engine.sglang.version import PINNED_SGLANG_VERSION, installed_sglang_version
from tests.engine.sglang_source import compile_from

if installed_sglang_version() != PINNED_SGLANG_VERSION:
    pytest.skip(
        f"sglang=={PINNED_SGLANG_VERSION} not installed (pip install --no-deps "
        f"sglang=={PINNED_SGLANG_VERSION})",
        allow_module_level=True,
    )

_SPEC = importlib.util.find_spec("sglang")  # top-level spec: does not run sglang/__init__
assert _SPEC is not None and _SPEC.origin is not None
SGLANG_DIR = Path(_SPEC.origin).parent
DECODE_PY = SGLANG_DIR / "srt/disaggregation/decode.py"
CONN_PY = SGLANG_DIR / "srt/disaggregation/common/conn.py"
UTILS_PY = SGLANG_DIR / "srt/disaggregation/utils.py"
BASE_PY = SGLANG_DIR / "srt/disaggregation/base/conn.py"

QUEUE_METHODS = (
    "__init__",
    "_defer_release",
    "resolve_deferred_releases",
    "_do_release",
    "_release_request",
    "_is_host_destination",
    "_observe_deferred_kv_release",
    "has_pending_deferred_releases",
)
KV_MGR_METHODS = (
    "register_deferred_abort_room",
    "note_abort_ack",
    "is_abort_release_safe",
    "clear_deferred_abort_state",
    # peer failure (heartbeat thread) and what it calls
    "_handle_node_failure",
    "check_status",
    "update_status",
    "record_failure",
)
PREFILL_ADDR = "prefill-0:8998"
EPOCH = 1_800_000_000.0  # strict_world(fake_wall=True): wall clock = EPOCH + the fake clock
# CAS_TEST_UNPATCHED=1: the tests marked "guards" run on unpatched code and must fail.
UNPATCHED = os.environ.get("CAS_TEST_UNPATCHED") == "1"


def compile_real(
    path: Path,
    namespace: dict[str, Any],
    *,
    cls: str | None,
    names: tuple[str, ...],
    as_name: str | None = None,
) -> Any:
    """Compile the named real functions (of class ``cls``, or module level) from ``path``."""
    return compile_from(path, namespace, cls=cls, names=names, as_name=as_name)


def real_class(path: Path, name: str) -> Any:
    """Compile the whole real class ``name`` from ``path`` (for plain constant classes)."""
    return compile_from(path, {}, cls=name, whole=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class AckState:  # stands in for the msgspec.Struct DeferredAbortAckState
    generation: int
    prefill_ranks: set[int]


class Env:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def build_world(deferred_enabled: bool = True) -> SimpleNamespace:
    """Real SGLang classes (compiled from the installed files) wired to CPU stubs."""
    clock = FakeClock()
    released: list[int] = []
    dist = SimpleNamespace(
        get_world_size=lambda group: 1,
        all_reduce=None,
        ReduceOp=SimpleNamespace(MIN="min", MAX="max"),
        ProcessGroup=object,
    )
    torch = SimpleNamespace(distributed=dist, tensor=None, int32=None)
    utils_ns: dict[str, Any] = {"dist": dist, "torch": torch, "List": list}
    compile_real(UTILS_PY, utils_ns, cls=None, names=("all_reduce_flags",))
    envs = SimpleNamespace(
        SGLANG_DISAGG_STAGING_BUFFER=Env(False),
        SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=Env(deferred_enabled),
        SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=Env(30.0),
    )
    decode_ns: dict[str, Any] = {
        "time": clock,
        "torch": torch,
        "logger": SimpleNamespace(warning=lambda *a: None, exception=lambda *a: None),
        "all_reduce_flags": utils_ns["all_reduce_flags"],
        "envs": envs,
        "get_parallel": lambda: SimpleNamespace(
            attn_tp_group=SimpleNamespace(cpu_group=None), tp_rank=0
        ),
        "get_disagg": lambda: SimpleNamespace(disaggregation_decode_host_receive_threshold=1.0),
        "release_kv_cache": lambda req, tree_cache, checkpoint: released.append(req.bootstrap_room),
        "discard_kv_cache_backup": None,
        "List": list,
        "Tuple": tuple,
    }
    queue_cls = compile_real(DECODE_PY, decode_ns, cls="DecodeTransferQueue", names=QUEUE_METHODS)
    kvpoll = real_class(BASE_PY, "KVPoll")
    disconnected: list[str] = []
    conn_ns: dict[str, Any] = {
        "DeferredAbortAckState": AckState,
        "KVPoll": kvpoll,
        "logger": SimpleNamespace(error=lambda *a: None),
        "NetworkAddress": lambda ip, port: SimpleNamespace(to_tcp=lambda: f"tcp://{ip}:{port}"),
        "CommonKVReceiver": SimpleNamespace(disconnect_endpoint=disconnected.append),
    }
    mgr_cls = compile_real(
        CONN_PY, conn_ns, cls="CommonKVManager", names=KV_MGR_METHODS, as_name="RealAckBookkeeping"
    )
    return SimpleNamespace(
        clock=clock,
        released=released,
        queue_cls=queue_cls,
        mgr_cls=mgr_cls,
        kvpoll=kvpoll,
        disconnected=disconnected,
    )


def make_queue(world: SimpleNamespace) -> Any:
    freed_meta: list[int] = []
    scheduler = SimpleNamespace(
        spec_algorithm=None,
        enable_hisparse=False,
        metrics_reporter=SimpleNamespace(enable_metrics=False),
    )
    q = world.queue_cls(
        req_to_metadata_buffer_idx_allocator=SimpleNamespace(free=freed_meta.append),
        metadata_buffers=SimpleNamespace(clear_slot=lambda idx: None),
        scheduler=scheduler,
        tree_cache=None,
    )
    q.freed_meta = freed_meta
    return q


def make_kv_mgr(world: SimpleNamespace) -> Any:
    mgr = world.mgr_cls()
    mgr._deferred_abort_ack_tracker = {}
    mgr._deferred_abort_generation = 0
    mgr.enable_deferred_decode_kv_release = True
    # what _handle_node_failure / update_status read on the decode side
    mgr.connection_lock = threading.Lock()
    mgr.connection_pool = {f"{PREFILL_ADDR}_0": [{"rank_ip": "prefill-0", "rank_port": 9100}]}
    mgr.prefill_info_table = {PREFILL_ADDR: object()}
    mgr.heartbeat_failures = {PREFILL_ADDR: 3}
    mgr.addr_to_rooms_tracker = defaultdict(set)
    mgr.request_status = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr.deferred_bootstrap = None
    return mgr


def abort_room(world: SimpleNamespace, q: Any, mgr: Any, room: int, ranks: int) -> int:
    """Decode aborts a room mid-transfer: arm the ack tracker and hold the request."""
    generation = mgr.register_deferred_abort_room(room)
    receiver = SimpleNamespace(
        kv_mgr=mgr,
        abort_notified=True,
        bootstrap_infos=[object()] * ranks,
        bootstrap_addr=PREFILL_ADDR,
        clear=lambda: None,
    )
    req = SimpleNamespace(bootstrap_room=room, rid=f"r{room}")
    q._defer_release(
        SimpleNamespace(
            req=req, kv_receiver=receiver, host_staged=False, metadata_buffer_index=room
        )
    )
    return generation


def test_unpatched_upstream_releases_on_the_timer() -> None:
    """Baseline of the real 0.5.23 code: no ack, 30 s pass, the slot is released anyway.
    If this stops failing-open, upstream fixed it and the patch should be revisited."""
    world = build_world()
    q, mgr = make_queue(world), make_kv_mgr(world)
    abort_room(world, q, mgr, room=11, ranks=2)
    world.clock.now += 29.0
    q.resolve_deferred_releases()
    assert world.released == []
    world.clock.now += 2.0
    q.resolve_deferred_releases()
    assert world.released == [11]


def test_strict_patch_holds_past_timer_and_releases_on_all_acks() -> None:
    """Guards Bug 1 in SGLang: after the patch, only acks from every prefill rank of the
    current generation release the slot; the timer and stale acks do not."""
    world = build_world()
    reg = CollectorRegistry()
    patch = reclaim.install_strict_reclaim(
        world.queue_cls,
        quarantine_budget_rooms=0,
        metrics=KvFenceMetrics(reg),
        clock=world.clock.monotonic,
    )
    q, mgr = make_queue(world), make_kv_mgr(world)
    assert q.deferred_kv_release_timeout == math.inf and q._cas_upstream_timeout_s == 30.0
    gen = abort_room(world, q, mgr, room=11, ranks=2)
    world.clock.now += 3600.0
    q.resolve_deferred_releases()
    assert world.released == [] and q.has_pending_deferred_releases()
    assert patch.overdue_rooms == 1
    assert patch.health()[0] is False
    assert reg.get_sample_value("cas_kv_quarantined_rooms") == 1
    assert reg.get_sample_value("cas_kv_unhealthy_by_quarantine") == 1
    mgr.note_abort_ack(11, 0, gen - 1)  # stale generation
    mgr.note_abort_ack(11, 0, gen)
    q.resolve_deferred_releases()
    assert world.released == []
    mgr.note_abort_ack(11, 1, gen)
    q.resolve_deferred_releases()
    assert world.released == [11] and q.freed_meta == [11]
    assert not q.has_pending_deferred_releases()
    assert patch.health() == (True, "")
    assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "acked"}) == 1
    assert mgr._deferred_abort_ack_tracker == {}


def test_patch_is_idempotent_and_refuses_disabled_deferred_release() -> None:
    """Installing twice must not double-wrap; with deferred release off, start-up fails."""
    world = build_world(deferred_enabled=False)
    first = reclaim.install_strict_reclaim(world.queue_cls)
    assert reclaim.install_strict_reclaim(world.queue_cls) is first
    with pytest.raises(reclaim.StrictReclaimError, match="DEFERRED_DECODE_KV_RELEASE=1"):
        make_queue(world)


def test_check_refuses_changed_upstream_code() -> None:
    """If the timer logic of the installed SGLang differs, the patch must refuse to start."""
    world = build_world()

    class Changed(world.queue_cls):  # type: ignore[misc,name-defined]
        def resolve_deferred_releases(self) -> None:
            return None

    Changed.__init__ = world.queue_cls.__init__
    Changed._defer_release = world.queue_cls._defer_release
    Changed._do_release = world.queue_cls._do_release
    with pytest.raises(reclaim.StrictReclaimError, match="no longer contains"):
        reclaim.check_decode_queue(Changed)

    class Missing:
        pass

    with pytest.raises(reclaim.StrictReclaimError, match="missing"):
        reclaim.check_decode_queue(Missing)


def test_loading_the_real_module_fails_with_a_clear_reason_or_works() -> None:
    """On CPU without torch the import fails; the error must say which module is missing."""
    try:
        cls = reclaim.load_decode_queue_class()
    except reclaim.StrictReclaimError as exc:
        assert "cannot import sglang.srt.disaggregation.decode" in str(exc)
        assert "No module named" in str(exc)
    else:
        reclaim.check_decode_queue(cls)


def test_env_defaults_turn_deferred_release_on_without_overriding() -> None:
    """The launcher enables deferred release; an explicit operator setting wins (then the
    patched queue refuses to start, see above)."""
    env: dict[str, str] = {}
    reclaim.apply_env_defaults(env)
    assert env == {reclaim.ENABLE_ENV: "1"}
    env = {reclaim.ENABLE_ENV: "0"}
    reclaim.apply_env_defaults(env)
    assert env[reclaim.ENABLE_ENV] == "0"


def test_backend_capability_read_from_real_sources() -> None:
    """Strict mode must refuse a transfer backend that frees aborted transfers at once
    (SGLang's fake backend) and accept mooncake, whose manager defers the release."""
    assert reclaim.backend_supports_deferred_release("mooncake")
    assert reclaim.backend_supports_deferred_release("nixl")
    assert not reclaim.backend_supports_deferred_release("fake")
    reclaim.require_deferred_capable_backend("mooncake")
    with pytest.raises(reclaim.StrictReclaimError, match="releases aborted transfers at once"):
        reclaim.require_deferred_capable_backend("fake")
    with pytest.raises(reclaim.StrictReclaimError, match="unknown"):
        reclaim.require_deferred_capable_backend("../etc")


# ---- peer death: release only on the transfer engine's confirmed endpoint close ----------------


def bootstrap_room(world: SimpleNamespace, mgr: Any, room: int) -> None:
    """A receiver bootstrapped ``room`` against the prefill (what CommonKVReceiver records)."""
    mgr.addr_to_rooms_tracker[PREFILL_ADDR].add(room)
    mgr.request_status[room] = world.kvpoll.Transferring


def strict_world(
    *, fake_wall: bool = False
) -> tuple[SimpleNamespace, Any, Any, Any, CollectorRegistry]:
    """Decode world with the strict patch and its peer hooks (None patch if UNPATCHED);
    ``fake_wall``: the patch's wall and perf clocks follow the fake clock too (EPOCH + now)."""
    world = build_world()
    reg = CollectorRegistry()
    clocks: dict[str, Any] = {}
    if fake_wall:
        clocks = {
            "wall_clock": lambda: EPOCH + world.clock.now,
            "perf_clock": world.clock.monotonic,
        }
    patch = None
    if not UNPATCHED:
        patch = reclaim.install_strict_reclaim(
            world.queue_cls,
            kv_mgr_cls=world.mgr_cls,
            metrics=KvFenceMetrics(reg),
            clock=world.clock.monotonic,
            **clocks,
        )
    return world, patch, make_queue(world), make_kv_mgr(world), reg


def confirm_closed(patch: Any, addr: str) -> None:
    if patch is not None:
        patch.on_peer_endpoint_closed(addr)


def test_peer_dead_without_endpoint_close_keeps_slots_quarantined() -> None:
    """guards: the heartbeat declares the prefill dead (real _handle_node_failure); a dead
    peer's write may still land, so nothing is released however long it takes."""
    world, _, q, mgr, reg = strict_world()
    bootstrap_room(world, mgr, 11)
    gen = abort_room(world, q, mgr, room=11, ranks=2)
    mgr.note_abort_ack(11, 0, gen)  # one rank acked before the peer died
    q.resolve_deferred_releases()
    mgr._handle_node_failure(PREFILL_ADDR)
    assert mgr.request_status[11] == world.kvpoll.Failed  # upstream's own reaction ran
    assert world.disconnected == ["tcp://prefill-0:9100"]
    for _ in range(3):
        world.clock.now += 3600.0
        q.resolve_deferred_releases()
    assert world.released == []
    assert q.has_pending_deferred_releases()
    assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "peer_closed"}) == 0


def test_peer_dead_then_endpoint_closed_releases_slots() -> None:
    """guards: once the transfer engine confirms the dead peer's endpoint closed, no write can
    land: the held slots go back (outcome peer_closed), without waiting for the missing ack."""
    world, patch, q, mgr, reg = strict_world()
    bootstrap_room(world, mgr, 11)
    gen = abort_room(world, q, mgr, room=11, ranks=2)
    mgr.note_abort_ack(11, 0, gen)
    q.resolve_deferred_releases()
    mgr._handle_node_failure(PREFILL_ADDR)
    world.clock.now += 5.0
    q.resolve_deferred_releases()
    assert world.released == []
    confirm_closed(patch, PREFILL_ADDR)
    q.resolve_deferred_releases()
    assert world.released == [11] and q.freed_meta == [11]
    assert not q.has_pending_deferred_releases()
    assert mgr._deferred_abort_ack_tracker == {}
    assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "peer_closed"}) == 1
    assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "acked"}) == 0
    assert reg.get_sample_value("cas_kv_reclaim_wait_seconds_sum") == 5.0


def test_endpoint_close_releases_only_the_dead_incarnations_rooms() -> None:
    """guards: a room bootstrapped after the peer died (a restarted prefill at the same address)
    is written by a live process; the old process's endpoint close must not release it. A room
    of the dead process that is held only after the close is released at once."""
    world, patch, q, mgr, reg = strict_world()
    bootstrap_room(world, mgr, 11)
    bootstrap_room(world, mgr, 13)
    abort_room(world, q, mgr, room=11, ranks=1)
    q.resolve_deferred_releases()
    mgr._handle_node_failure(PREFILL_ADDR)
    bootstrap_room(world, mgr, 12)  # after the death: the new incarnation's room
    abort_room(world, q, mgr, room=12, ranks=1)
    q.resolve_deferred_releases()
    confirm_closed(patch, PREFILL_ADDR)
    q.resolve_deferred_releases()
    assert world.released == [11]
    abort_room(world, q, mgr, room=13, ranks=1)  # the dead process's room, held after the close
    q.resolve_deferred_releases()
    assert world.released == [11, 13]
    world.clock.now += 3600.0
    q.resolve_deferred_releases()
    assert world.released == [11, 13]  # room 12 waits for its own ack
    assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "peer_closed"}) == 2


def test_check_covers_the_peer_hooks() -> None:
    """Start-up must refuse a KV manager whose peer-failure or release predicate changed."""
    world = build_world()
    reclaim.check_peer_hooks(world.mgr_cls)

    class Changed(world.mgr_cls):  # type: ignore[misc,name-defined]
        def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
            return True

    Changed._handle_node_failure = world.mgr_cls._handle_node_failure
    with pytest.raises(reclaim.StrictReclaimError, match="is_abort_release_safe no longer"):
        reclaim.check_peer_hooks(Changed)

    class Missing:
        is_abort_release_safe = world.mgr_cls.is_abort_release_safe

    with pytest.raises(reclaim.StrictReclaimError, match="_handle_node_failure is missing"):
        reclaim.check_peer_hooks(Missing)


# ---- the operator's confirmation: prefill pods gone for good (kvfence.gone_feed) ---------------


def gone_world() -> tuple[SimpleNamespace, Any, Any, Any, CollectorRegistry]:
    """Strict decode world whose patch reads wall and SGLang's perf clock from the fake clock."""
    return strict_world(fake_wall=True)


def hold_bootstrapped(
    world: SimpleNamespace, q: Any, mgr: Any, room: int, bootstrapped_at: float | None
) -> None:
    """A room whose handshake SGLang stamped at perf time ``bootstrapped_at`` (None: never),
    aborted mid-transfer and held (one prefill rank, no ack)."""
    bootstrap_room(world, mgr, room)
    mgr.register_deferred_abort_room(room)
    receiver = SimpleNamespace(
        kv_mgr=mgr,
        abort_notified=True,
        bootstrap_infos=[object()],
        bootstrap_addr=PREFILL_ADDR_IP,
        clear=lambda: None,
    )
    stats = SimpleNamespace(bootstrap_done_time=bootstrapped_at or 0.0)
    req = SimpleNamespace(bootstrap_room=room, rid=f"r{room}", time_stats=stats)
    q._defer_release(
        SimpleNamespace(
            req=req, kv_receiver=receiver, host_staged=False, metadata_buffer_index=room
        )
    )


PREFILL_ADDR_IP = "10.20.0.7:8998"


def gone(finished_at_perf: float) -> GonePrefill:
    return GonePrefill("10.20.0.7", 8998, EPOCH + finished_at_perf, "ns/prefill-0", "uid-1")


def cause(reg: CollectorRegistry, name: str) -> float | None:
    return reg.get_sample_value("cas_kv_quarantined_rooms_by_cause", {"cause": name})


def test_operator_confirmed_end_releases_rooms_bootstrapped_before_it() -> None:
    """guards: a deleted prefill pod's IP answers nothing, so no probe ever refuses and its
    rooms were held forever. The operator's confirmation (containers terminated at T) frees the
    rooms whose handshake completed before T minus the clock skew; a room bootstrapped inside
    the skew window, or never, stays held, as does everything after an hour without it."""
    world, patch, q, mgr, reg = gone_world()
    hold_bootstrapped(world, q, mgr, 11, bootstrapped_at=world.clock.now)
    hold_bootstrapped(world, q, mgr, 12, bootstrapped_at=world.clock.now + 55.0)
    hold_bootstrapped(world, q, mgr, 13, bootstrapped_at=None)
    q.resolve_deferred_releases()
    if patch is not None:
        assert cause(reg, "awaiting_ack") == 3 and cause(reg, "peer_dead") == 0
        patch.on_prefill_gone(gone(finished_at_perf=world.clock.now + 60.0))
    world.clock.now += 3600.0
    q.resolve_deferred_releases()
    assert world.released == [11]
    for _ in range(3):
        world.clock.now += 3600.0
        q.resolve_deferred_releases()
    assert world.released == [11]
    assert reg.get_sample_value("cas_kv_reclaims_total", {"outcome": "prefill_gone"}) == 1
    assert reg.get_sample_value("cas_kv_quarantined_rooms") == 2
    assert cause(reg, "awaiting_ack") == 2


def test_confirmation_before_the_hold_frees_the_room_when_held_and_counts_dead_peers() -> None:
    """guards: the operator's entry can arrive before decode aborts the room (the heartbeat
    declares the peer dead only later); the room is then released at once when held. Rooms of a
    peer the heartbeat declared dead are counted as peer_dead until released."""
    world, patch, q, mgr, reg = gone_world()
    hold_bootstrapped(world, q, mgr, 21, bootstrapped_at=world.clock.now)
    q.resolve_deferred_releases()
    mgr._handle_node_failure(PREFILL_ADDR_IP)
    q.resolve_deferred_releases()
    if patch is not None:
        assert cause(reg, "peer_dead") == 1 and cause(reg, "awaiting_ack") == 0
        patch.on_prefill_gone(gone(finished_at_perf=world.clock.now + 30.0))
    q.resolve_deferred_releases()
    assert world.released == [21]
    hold_bootstrapped(world, q, mgr, 22, bootstrapped_at=world.clock.now + 1.0)
    world.clock.now += 3600.0
    q.resolve_deferred_releases()
    assert world.released == [21, 22]
    assert reg.get_sample_value("cas_kv_quarantined_rooms") == 0


def test_check_covers_the_handshake_stamp() -> None:
    """Start-up must refuse an SGLang whose prealloc queue no longer stamps the handshake's
    completion where the patch reads it (the real 0.5.23 method passes)."""
    real = compile_real(
        DECODE_PY, {}, cls=reclaim.BOOTSTRAP_CLASS, names=tuple(reclaim.BOOTSTRAP_FINGERPRINTS)
    )
    reclaim.check_bootstrap_stamp(real)

    class Changed:
        def _update_handshake_waiters(self, poll: Any, KVPoll: Any) -> None:  # the stamp gone
            if poll == KVPoll.Bootstrapping:
                return
            elif poll == KVPoll.WaitingForInput:
                poll.waiting_for_input = True

    with pytest.raises(reclaim.StrictReclaimError, match="set_bootstrap_done_time"):
        reclaim.check_bootstrap_stamp(Changed)


SCHEDULER_PY = SGLANG_DIR / "srt/managers/scheduler.py"


def real_idle_scheduler(world: SimpleNamespace, q: Any, *, busy: bool) -> Any:
    """A decode Scheduler stand-in whose ``is_fully_idle`` is SGLang's own (scheduler.py),
    reading the real transfer queue ``q``; ``busy``: a request is running."""
    mode = compile_from(UTILS_PY, {"Enum": Enum}, cls="DisaggregationMode", whole=True)
    ns: dict[str, Any] = {
        "DisaggregationMode": mode,
        "get_parallel": lambda: SimpleNamespace(pp_size=1),
    }
    cls = compile_real(
        SCHEDULER_PY, ns, cls="Scheduler", names=("is_fully_idle", "_pp_microbatches_drained")
    )
    empty = SimpleNamespace(is_empty=lambda: True, reqs=[])
    sched = cls.__new__(cls)
    sched.__dict__.update(
        running_batch=SimpleNamespace(is_empty=lambda: not busy),
        chunked_req=None,
        dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False),
        last_batch=empty,
        enable_overlap=False,
        waiting_queue=[],
        _engine_paused=False,
        disaggregation_mode=mode.DECODE,
        disagg_decode_prealloc_queue=SimpleNamespace(queue=[], retracted_queue=[]),
        disagg_decode_transfer_queue=q,
        grammar_manager=SimpleNamespace(grammar_queue=[]),
        decode_offload_manager=None,
        enable_hisparse=False,
        enable_hierarchical_cache=False,
        enable_lmcache=False,
    )
    q.queue = []
    q.scheduler = sched
    return sched


def test_held_rooms_that_alone_block_idle_are_reported() -> None:
    """Regression: held rooms keep SGLang's real is_fully_idle False, which skips the leak check
    and refuses /flush_cache, silently and for as long as the rooms are held. The patch keeps
    that (a flush would free pages under a live write) but reports it:
    cas_kv_idle_blocked_by_held_rooms is 1 only while held rooms are the sole work."""
    world, patch, q, mgr, reg = gone_world()
    assert patch is not None
    sched = real_idle_scheduler(world, q, busy=False)
    hold_bootstrapped(world, q, mgr, 31, bootstrapped_at=None)
    q.resolve_deferred_releases()
    assert sched.is_fully_idle() is False  # upstream: held rooms keep it busy
    assert reg.get_sample_value("cas_kv_idle_blocked_by_held_rooms") == 1
    assert len(q._deferred_releases) == 1  # the observation put the held room back
    busy = real_idle_scheduler(world, q, busy=True)
    q.resolve_deferred_releases()
    assert busy.is_fully_idle() is False
    assert reg.get_sample_value("cas_kv_idle_blocked_by_held_rooms") == 0
