"""The prefix reuse hook against the real SGLang 0.5.23 code (skipped where SGLang does not
import; a skip fails under CI, tests/engine/conftest.py).

Installs the patch on SGLang's own ``Scheduler`` class and runs its own
``handle_generate_request`` (srt/managers/scheduler.py:2943) on a real
``TokenizedGenerateReqInput`` (its ``input_ids`` an ``array('q')``) with a stand-in for the
scheduler's state: the prompt is tracked on a prefill scheduler, not on a decode one, and
SGLang's own code still hands the very same request on to ``_handle_generate_request``.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from cas_engine.prefixreuse import ReuseTracker
from tests.engine.sglang_real import sglang_import_problem

SCHEDULER = "sglang.srt.managers.scheduler"
WHY_NOT = sglang_import_problem(SCHEDULER, "sglang.srt.managers.io_struct")
pytestmark = [pytest.mark.sglang_real, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

if WHY_NOT is None:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams


def _request(ids: list[int]) -> Any:
    return io_struct.TokenizedGenerateReqInput(
        rid="r1",
        input_text=None,
        input_ids=array("q", ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=4),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
    )


def _scheduler(mode: Any) -> Any:
    handed: list[Any] = []
    state = SimpleNamespace(disaggregation_mode=mode, handed=handed)
    state._handle_generate_request = lambda req, cleanup, mm_input_error: handed.append(req)
    return state


def test_the_real_scheduler_method_is_hooked_and_still_hands_the_request_on() -> None:
    from cas_engine.sglang.prefix_reuse import check_targets, install_prefix_reuse

    assert check_targets(Scheduler) == []
    tracker = ReuseTracker(sample_rate=1)
    patch = install_prefix_reuse(tracker=tracker, reporting_rank=lambda: True)
    try:
        assert patch.cls is Scheduler
        prefill = _scheduler(DisaggregationMode.PREFILL)
        req = _request(list(range(64 * 5 + 3)))
        Scheduler.handle_generate_request(prefill, req)
        assert prefill.handed == [req]
        assert len(tracker) == 5
        again = tracker.observe(list(range(64 * 5 + 3)))
        assert len(again.reuse_s) == 5  # the hook saw exactly these tokens

        decode = _scheduler(DisaggregationMode.DECODE)
        decode_tracker = ReuseTracker(sample_rate=1)
        patch.uninstall()
        patch = install_prefix_reuse(tracker=decode_tracker, reporting_rank=lambda: True)
        Scheduler.handle_generate_request(decode, _request(list(range(640))))
        assert len(decode.handed) == 1 and len(decode_tracker) == 0
    finally:
        patch.uninstall()
    assert check_targets(Scheduler) == []


def test_the_reporting_rank_reads_sglangs_parallel_context() -> None:
    """Outside a launched engine SGLang's parallel context is unset or rank 0: the single
    process records (as the guard's reporting rank does)."""
    from cas_engine.sglang.prefix_reuse import _default_reporting_rank

    assert _default_reporting_rank() is True
