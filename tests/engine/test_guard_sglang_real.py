"""The guard patch against the real SGLang 0.5.23 code (skipped where SGLang does not import).

Runs SGLang's own ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` under the patch
with stub collaborators and CPU tensors, then feeds the abort it produced through SGLang's
own ``TokenizerManager._handle_abort_finish_reason``. Needs torch and SGLang's Python deps
(see docs/engine.md); importing them takes ~20 s, hence a separate file.
"""

from __future__ import annotations

import asyncio
import dataclasses
from array import array
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cas_engine.guard import GuardConfig
from tests.engine.sglang_real import sglang_import_problem

BRP = "sglang.srt.managers.scheduler_components.batch_result_processor"
WHY_NOT = sglang_import_problem(BRP)
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

if WHY_NOT is None:
    import torch
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

STRIDE = 4  # speculative_num_draft_tokens: 3 drafts + 1 bonus slot per request row


class StubReq:
    """The Req attributes _resolve_spec_v2_tokens touches."""

    def __init__(self, rid: str, slot: int) -> None:
        self.rid = rid
        self.kv = SimpleNamespace(req_pool_idx=slot, kv_committed_len=0)
        self.is_retracted = False
        self.grammar = None
        self.to_finish = None
        self.spec_verify_ct = 0
        self.spec_num_correct_drafts = 0
        self.histogram: list[int] = []
        self.output_ids = array("q")  # SGLang's Req.output_ids (schedule_batch.py:1100)

    def finished(self) -> bool:
        return False

    def update_spec_correct_drafts_histogram(self, n: int) -> None:
        self.histogram.append(n)


def _processor() -> Any:
    cls = brp.SchedulerBatchResultProcessor
    stubs: dict[str, Any] = {f.name: None for f in dataclasses.fields(cls)}
    stubs.update(
        enable_overlap=False,
        enable_overlap_mlx=False,
        req_to_token_pool=SimpleNamespace(size=8),
        metrics_reporter=SimpleNamespace(snapshot_spec_decode_metrics=lambda b, r: None),
        model_worker=SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
    )
    return cls(**stubs)


def _result(accept_lens: list[int]) -> Any:
    return SimpleNamespace(
        next_token_ids=torch.arange(len(accept_lens) * STRIDE, dtype=torch.int64),
        accept_lens=torch.tensor(accept_lens, dtype=torch.int64),
        speculative_output_stride=STRIDE,
        speculative_num_draft_tokens=STRIDE,
        num_non_draft_tokens_per_req=1,
        block_accept_lens=None,
        cap_lens=None,
        grammar_advanced=False,
    )


def test_real_class_matches_the_patch_targets() -> None:
    """Regression: the pinned SGLang still has the accounting lines the patch relies on."""
    from sglang.srt.managers.schedule_batch import Req

    from cas_engine.sglang.guard_patch import check_req_class, check_targets

    assert check_targets(brp.SchedulerBatchResultProcessor) == []
    assert check_req_class(Req) == []


def test_real_resolve_step_trips_and_sets_a_503_abort() -> None:
    """Regression: on SGLang's own code path, only the corrupted request gets a 503 abort."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from cas_engine.sglang.guard_patch import install_guard_patch

    handle = install_guard_patch(GuardConfig(), proposed_per_step=lambda: STRIDE - 1)
    try:
        proc = _processor()
        good, bad = StubReq("good", 1), StubReq("bad", 2)
        batch = SimpleNamespace(reqs=[good, bad], has_grammar=False)
        tripped_at = None
        for step in range(1, 200):
            tokens = proc._resolve_spec_v2_tokens(_result([3, 1]), batch)
            assert [len(t) for t in tokens] == [3, 1]  # SGLang's output is unchanged
            if bad.to_finish is not None and tripped_at is None:
                tripped_at = step
        assert tripped_at == 129  # 1 token per step for the corrupted request
        assert good.to_finish is None and bad.spec_verify_ct == 199
        assert isinstance(bad.to_finish, FINISH_ABORT)
        assert bad.to_finish.status_code is HTTPStatus.SERVICE_UNAVAILABLE
        assert "low_accept_length" in bad.to_finish.message
    finally:
        handle.uninstall()


def test_real_step_keeps_a_verbatim_copy_and_aborts_repetition() -> None:
    """Regression (issue 13): every draft accepted is what a verbatim copy of a file looks like
    as much as degenerate repetition; on SGLang's own step, with the requests' own
    `output_ids`, only the repeating one is aborted (high_accept_rate)."""
    from cas_engine.sglang.guard_patch import install_guard_patch
    from cas_engine.sim.textgen import _WORD, token_id

    code = (Path(__file__).resolve().parents[2] / "engine/cas_engine/guard/monitor.py").read_text()
    copy_ids = [token_id(w) for w in _WORD.findall(code)]
    loop_ids = [token_id(w) for w in _WORD.findall("the same line again\n" * 200)]
    handle = install_guard_patch(GuardConfig(), proposed_per_step=lambda: STRIDE - 1)
    try:
        proc = _processor()
        copy, loop = StubReq("copy", 1), StubReq("loop", 2)
        batch = SimpleNamespace(reqs=[copy, loop], has_grammar=False)
        for step in range(1, 120):
            proc._resolve_spec_v2_tokens(_result([STRIDE, STRIDE]), batch)
            for req, ids in ((copy, copy_ids), (loop, loop_ids)):  # the scheduler appends
                req.output_ids = array("q", ids[: STRIDE * step])
        assert copy.to_finish is None
        assert loop.to_finish is not None and "high_accept_rate" in loop.to_finish.message
    finally:
        handle.uninstall()


def test_real_tokenizer_turns_the_abort_into_http_503() -> None:
    """Regression: the abort we set must reach the client as a retryable 503, not a 400/200."""
    from fastapi import HTTPException
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    abort = FINISH_ABORT(
        "cas_guard_tripped: reason=low_accept_length", HTTPStatus.SERVICE_UNAVAILABLE
    )
    out = {"meta_info": {"finish_reason": abort.to_json()}}
    state = SimpleNamespace(obj=SimpleNamespace(rid="bad"))
    tm = SimpleNamespace(rid_to_state={"bad": state}, _release_lora_once=lambda s: None)
    handler = TokenizerManager._handle_abort_finish_reason
    with pytest.raises(HTTPException) as exc:
        asyncio.run(handler(tm, out, state, False))
    assert exc.value.status_code == 503 and "low_accept_length" in exc.value.detail
    assert asyncio.run(handler(tm, out, state, True)) is out  # streaming: error chunk path


def test_sglang_plugin_loader_installs_our_patches_in_a_fresh_process(tmp_path) -> None:
    """Regression: SGLang's spawned workers get our patches only through its plugin loader."""
    import os
    import subprocess
    import sys

    probe = (
        "import importlib.metadata as md, sys\n"
        "import sglang.srt.plugins as plugins\n"
        "ep = md.EntryPoint(name='cas_engine', value='cas_engine.launch:sglang_plugin',\n"
        "                   group='sglang.srt.plugins')\n"
        "plugins.entry_points = lambda group: [ep] if group == 'sglang.srt.plugins' else []\n"
        "plugins.load_plugins()\n"
        "from sglang.srt.managers.scheduler_components.batch_result_processor import (\n"
        "    SchedulerBatchResultProcessor as P)\n"
        "from sglang.srt.disaggregation.decode import DecodeTransferQueue as Q\n"
        "print('GUARD', hasattr(P._resolve_spec_v2_tokens, '__cas_guard_original__'))\n"
        "print('RECLAIM', '_cas_strict_reclaim' in Q.__dict__)\n"
    )
    env = dict(
        os.environ,
        CAS_ENGINE_PATCHES="1",
        CAS_KV_RECLAIM="strict",
        CAS_GUARD_MIN_ACCEPT_LENGTH="1.5",
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=240, env=env
    )
    assert "GUARD True" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RECLAIM True" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _batch_output(cls: Any, finish_reason: dict[str, Any]) -> Any:
    """A real SGLang batch output struct carrying one finished request's reason (the other
    required fields empty: lists empty, optional ones None)."""
    import typing

    import msgspec

    fields: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        if f.required:
            fields[f.name] = None if type(None) in typing.get_args(f.type) else []
    fields["finished_reasons"] = [finish_reason]
    return cls(**fields)


def _stream(finish_reason: dict[str, Any]) -> list[str]:
    """SGLang's own OpenAI chat streaming (``OpenAIServingChat._generate_chat_stream``) over
    one generated chunk that ends with ``finish_reason``; collaborators it does not reach for
    this chunk (parsers, templates, the server config) are absent."""
    from sglang.srt.entrypoints.openai import serving_chat
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    class Absent:
        def __getattr__(self, name: str) -> None:
            return None

    class BareServingChat(serving_chat.OpenAIServingChat):
        def __getattr__(self, name: str) -> None:
            return None

    async def generate_request(adapted: Any, raw: Any) -> Any:
        meta = {"id": "r1", "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}
        yield {"index": 0, "text": "x", "meta_info": {**meta, "finish_reason": finish_reason}}

    chat = BareServingChat.__new__(BareServingChat)
    chat.tokenizer_manager = SimpleNamespace(generate_request=generate_request)
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )

    async def collect() -> list[str]:
        return [line async for line in chat._generate_chat_stream(None, request, None)]

    real_get_serving = serving_chat.get_serving
    serving_chat.get_serving = Absent  # type: ignore[assignment]
    try:
        return asyncio.run(collect())
    finally:
        serving_chat.get_serving = real_get_serving


def test_streaming_trip_survives_sglangs_pickle_ipc_and_is_lost_over_msgpack() -> None:
    """Regression (issue 13): a trip in a started stream reaches the client as an error event
    only because SGLang's IPC is pickle. The abort crosses two process hops inside SGLang's
    batch output structs; pickle (``sock_send``, the default) keeps its ``HTTPStatus``, and
    serving_chat ends the stream with the 503 error event. SGLang's msgpack IPC decodes the
    status as an int, and the same serving code ends the stream like a completed answer
    (``finish_reason: "abort"``, ``[DONE]``), which is why the launcher refuses it."""
    import pickle

    from sglang.srt.managers import io_struct
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    trip = FINISH_ABORT(
        "cas_guard_tripped: reason=low_accept_length", HTTPStatus.SERVICE_UNAVAILABLE
    ).to_json()
    for cls in (io_struct.BatchTokenIDOutput, io_struct.BatchStrOutput):  # both hops
        sent = _batch_output(cls, trip)
        by_pickle = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
        by_msgpack = io_struct.msgpack_decode(io_struct.msgpack_encode(sent))
        assert isinstance(by_pickle.finished_reasons[0]["status_code"], HTTPStatus)
        assert type(by_msgpack.finished_reasons[0]["status_code"]) is int
    over_pickle = _stream(by_pickle.finished_reasons[0])
    assert '"code": 503' in over_pickle[0] and "low_accept_length" in over_pickle[0]
    assert over_pickle[-1] == "data: [DONE]\n\n"
    over_msgpack = _stream(by_msgpack.finished_reasons[0])
    assert not any('"error"' in line for line in over_msgpack)
    assert any('"finish_reason":"abort"' in line for line in over_msgpack)


def test_launcher_refuses_the_gate_over_msgpack_ipc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 13): with ``SGLANG_USE_PICKLE_IPC=false`` a tripped stream would end
    as if complete; the launcher refuses, read with SGLang's own parsing of the variable."""
    from cas_engine.launch import LaunchRefused, check_guard_ipc
    from tests.engine.test_launch import _plan

    plan = _plan()
    monkeypatch.delenv("SGLANG_USE_PICKLE_IPC", raising=False)
    assert "pickle" in check_guard_ipc(plan)  # SGLang's default
    monkeypatch.setenv("SGLANG_USE_PICKLE_IPC", "0")
    with pytest.raises(LaunchRefused, match="SGLANG_USE_PICKLE_IPC"):
        check_guard_ipc(plan)
    observe = dataclasses.replace(plan, guard=GuardConfig(enabled=False))
    assert "observe" in check_guard_ipc(observe)
