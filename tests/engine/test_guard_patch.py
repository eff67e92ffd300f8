"""The SGLang guard patch: hooks, refusals and the abort it sets, on a replica and on SGLang.

The replica class below has the same method names, parameters and accounting lines as
``SchedulerBatchResultProcessor`` in SGLang 0.5.23, so the patch logic is tested without torch;
the tests at the end run the real class where SGLang (and torch) import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.guard import GuardConfig, GuardMetrics, GuardTrip
from cas_engine.sglang.guard_patch import GuardPatchError, check_targets, install_guard_patch

DRAFTS = 3  # proposed drafts per verify step (speculative_num_draft_tokens - 1)


@dataclass
class FakeReq:
    rid: str
    req_pool_idx: int
    to_finish: Any = None
    finished_reason: Any = None
    is_retracted: bool = False
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    kv: Any = field(init=False)

    def __post_init__(self) -> None:
        self.kv = SimpleNamespace(req_pool_idx=self.req_pool_idx)

    def finished(self) -> bool:
        return self.finished_reason is not None


class ReplicaProcessor:
    """Mimics the accounting of SGLang 0.5.23's SchedulerBatchResultProcessor."""

    req_to_token_pool = SimpleNamespace(size=16)

    def _resolve_spec_v2_tokens(self, result, batch):
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                pass
            else:
                req.spec_verify_ct += 1
                req.spec_num_correct_drafts += result.num_correct_drafts_per_req_cpu[i]
        return [[0] * (a + 1) for a in result.num_correct_drafts_per_req_cpu]

    def process_batch_result_decode(self, batch, result):
        self._resolve_spec_v2_tokens(result, batch)
        for req in batch.reqs:  # SGLang's update_finish_state: to_finish wins
            if not req.finished() and req.to_finish is not None:
                req.finished_reason, req.to_finish = req.to_finish, None


def _step(proc: Any, reqs: list[FakeReq], accepted: list[int]) -> None:
    batch = SimpleNamespace(reqs=reqs)
    proc.process_batch_result_decode(
        batch, SimpleNamespace(num_correct_drafts_per_req_cpu=accepted)
    )


def install_on_replica(**extra: Any) -> tuple[type, Any, CollectorRegistry]:
    """The gate (window 0) on a fresh replica subclass: (class, patch handle, registry)."""
    reg = CollectorRegistry()
    cfg = GuardConfig(window=0)

    class Proc(ReplicaProcessor):
        pass

    handle = install_guard_patch(
        cfg,
        metrics=GuardMetrics.create(reg, cfg),
        cls=Proc,
        abort_factory=lambda trip: ("abort", 503, trip),
        proposed_per_step=lambda: DRAFTS,
        **extra,
    )
    return Proc, handle, reg


@pytest.fixture
def patched():
    proc_cls, handle, reg = install_on_replica()
    yield proc_cls, handle, reg
    handle.uninstall()


def test_corrupted_request_is_aborted_with_503_and_healthy_one_is_not(patched) -> None:
    """Regression: the patch must abort exactly the bad request, in the step it trips."""
    proc_cls, handle, reg = patched
    proc = proc_cls()
    good, bad = FakeReq("good", 3), FakeReq("bad", 7)
    aborted_at = None
    for step in range(1, 200):
        _step(proc, [r for r in (good, bad) if not r.finished()], [2, 0][: 2 - bad.finished()])
        if bad.finished():
            aborted_at = step
            break
    assert aborted_at == 129  # 1 token per corrupted step; judged once > 128
    kind, status, trip = bad.finished_reason
    assert (kind, status) == ("abort", 503)
    assert isinstance(trip, GuardTrip) and trip.request_id == "bad"
    assert trip.reason == "low_accept_length"
    assert not good.finished() and good.spec_verify_ct == 129  # SGLang's own count unchanged
    # the finished request left the monitor: its histogram was recorded
    assert reg.get_sample_value("cas_guard_accept_length_count") == 1
    assert handle.adapter.rid_slot == {"good": 3}


def test_only_the_first_rank_of_an_attention_group_records_metrics() -> None:
    """Regression (issue 13): every TP rank of a decode runs the gate on the same batch, and
    each counted the trip: a TP-8 decode reported 8 trips per bad request. All ranks still
    abort it (they must agree); only the first rank of the group records it."""
    counts = []
    for first in (True, False):
        proc_cls, handle, reg = install_on_replica(reporting_rank=lambda first=first: first)
        proc, bad = proc_cls(), FakeReq("bad", 7)
        while not bad.finished():
            _step(proc, [bad], [0])
        assert bad.finished_reason[0] == "abort"
        counts.append(
            reg.get_sample_value("cas_guard_trips_total", {"reason": "low_accept_length"})
        )
        handle.uninstall()
    assert counts == [1.0, 0.0]


def test_the_reporting_rank_is_read_from_sglangs_parallel_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default reads attn_tp_rank / attn_cp_rank from SGLang 0.5.23's own ParallelContext
    (runtime_context.get_parallel); where nothing is published it counts as the first rank."""
    rc = pytest.importorskip("sglang.srt.runtime_context")
    from cas_engine.sglang.guard_patch import _default_reporting_rank

    monkeypatch.setattr(rc, "_PARALLEL", rc.ParallelContext())
    assert _default_reporting_rank() is True  # unpublished: a single-process engine
    second = rc.ParallelContext()
    second._stamp.update(attn_tp_rank=1, attn_cp_rank=0)
    monkeypatch.setattr(rc, "_PARALLEL", second)
    assert _default_reporting_rank() is False
    first = rc.ParallelContext()
    first._stamp.update(attn_tp_rank=0, attn_cp_rank=0)
    monkeypatch.setattr(rc, "_PARALLEL", first)
    assert _default_reporting_rank() is True


def test_slot_reuse_by_a_new_request_starts_fresh(patched) -> None:
    """Regression: a new rid in a reused req_pool_idx must not inherit the old statistics."""
    proc_cls, handle, _ = patched
    proc = proc_cls()
    first = FakeReq("first", 5)
    for _ in range(100):
        _step(proc, [first], [0])
    second = FakeReq("second", 5)  # first vanished without a finished() batch
    for _ in range(100):
        _step(proc, [second], [0])
    assert not second.finished()  # only 100 tokens of its own
    assert handle.adapter.monitor.stats(5).generated_tokens == 100


def test_retracted_and_finished_rows_are_not_counted(patched) -> None:
    """Regression: rows SGLang skips (retracted, overlap leftovers) must be skipped too."""
    proc_cls, handle, _ = patched
    proc = proc_cls()
    r = FakeReq("r", 2, is_retracted=True)
    for _ in range(200):
        _step(proc, [r], [0])
    assert handle.adapter.monitor is not None
    assert handle.adapter.monitor.request_id(2) is None


def test_adapter_errors_never_break_the_step() -> None:
    """Regression: a bug in the gate must leave SGLang's step and result untouched."""

    class Proc(ReplicaProcessor):
        pass

    def broken() -> int:
        raise ZeroDivisionError("injected")

    handle = install_guard_patch(
        GuardConfig(), cls=Proc, abort_factory=lambda t: t, proposed_per_step=broken
    )
    req = FakeReq("x", 1)
    out = Proc()._resolve_spec_v2_tokens(
        SimpleNamespace(num_correct_drafts_per_req_cpu=[2]), SimpleNamespace(reqs=[req])
    )
    assert out == [[0, 0, 0]] and req.spec_verify_ct == 1
    assert handle.adapter.errors == 1
    handle.uninstall()


def test_uninstall_restores_the_original_methods() -> None:
    """Regression: tests and reloads must be able to remove the patch."""

    class Proc(ReplicaProcessor):
        pass

    before = (Proc._resolve_spec_v2_tokens, Proc.process_batch_result_decode)
    handle = install_guard_patch(
        GuardConfig(), cls=Proc, abort_factory=lambda t: t, proposed_per_step=lambda: DRAFTS
    )
    assert Proc._resolve_spec_v2_tokens is not before[0]
    with pytest.raises(GuardPatchError, match="already patched"):
        install_guard_patch(GuardConfig(), cls=Proc, abort_factory=lambda t: t)
    handle.uninstall()
    assert (Proc._resolve_spec_v2_tokens, Proc.process_batch_result_decode) == before


def test_refuses_missing_method_changed_signature_and_changed_accounting() -> None:
    """Regression: hooking code whose meaning changed (another SGLang) must fail fast."""

    class NoDecode:
        def _resolve_spec_v2_tokens(self, result, batch):
            req.spec_verify_ct += 1  # noqa: F821 - source marker only
            return result.num_correct_drafts_per_req_cpu, "req.is_retracted or req.finished()"

    class Renamed(ReplicaProcessor):
        def process_batch_result_decode(self, batch, result, extra):
            return None

    class NoAccounting(ReplicaProcessor):
        def _resolve_spec_v2_tokens(self, result, batch):
            return []

    assert any("process_batch_result_decode is missing" in p for p in check_targets(NoDecode))
    assert any("expected parameters" in p for p in check_targets(Renamed))
    problems = check_targets(NoAccounting)
    assert any("spec_verify_ct += 1" in p for p in problems)
    with pytest.raises(GuardPatchError, match="spec_verify_ct"):
        install_guard_patch(GuardConfig(), cls=NoAccounting, abort_factory=lambda t: t)
    assert check_targets(ReplicaProcessor) == []


def test_req_class_check_requires_finished_to_mean_finished_reason() -> None:
    """Regression: finish_batch reads finished_reason in bulk; a changed finished() must refuse."""
    from cas_engine.sglang.guard_patch import check_req_class

    class Req:
        def finished(self) -> bool:
            return self.finished_reason is not None

    class ChangedReq:
        def finished(self) -> bool:
            return self.state == "done"

    assert check_req_class(Req) == []
    assert "finished_reason is not None" in check_req_class(ChangedReq)[0]
