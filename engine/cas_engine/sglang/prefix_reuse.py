"""Feed every prompt an SGLang 0.5.23 prefill (or non-PD) scheduler receives to the prefix-reuse
tracker (`cas_engine.prefixreuse`), whose metrics the operator's hit-rate model reads.

Where SGLang receives a request: ``Scheduler.handle_generate_request(self, recv_req, *,
mm_input_error=None)`` (``srt/managers/scheduler.py:2943``) gets each tokenized generate request
once per scheduler process: from the request dispatcher, which binds the method when the
scheduler is built (``init_request_dispatcher``, scheduler.py:1830; so the patch must be on the
class before any ``Scheduler`` exists, as SGLang's plugin loader ensures), from
``handle_batch_generate_request`` (scheduler.py:3340) and from the multimodal path
(scheduler.py:2376). ``recv_req.input_ids`` is the prompt's token ids, an ``array('q')``
(``srt/managers/io_struct.py:1068``); a request that carries ``input_embeds`` is given fake ids
later (scheduler.py:2982) and is skipped here, as is one whose multimodal inputs failed.

Who records: every attention-TP and CP rank (and pipeline stage) of an instance receives the
same requests, so only the first rank of each attention group on the first stage records (read
from SGLang's ``runtime_context.get_parallel()``); a decode scheduler
(``self.disaggregation_mode``, scheduler.py:1512) records nothing: its prompts were prefilled
and counted on a prefill instance. Each recording process has its own ghost map, as each has
its own radix cache.

Safety: :func:`check_targets` refuses (``PrefixReusePatchError``) when the method is missing,
its parameters changed, or its source no longer hands ``recv_req`` on as we rely on; the
wrapper never raises into SGLang (an error is logged once and the request is served untracked).
"""

from __future__ import annotations

import inspect
import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cas_engine.prefixreuse import ReuseMetrics, ReuseTracker

logger = logging.getLogger("cas_engine.sglang.prefix_reuse")

TARGET_MODULE = "sglang.srt.managers.scheduler"
TARGET_CLASS = "Scheduler"
HOOK = "handle_generate_request"
HOOK_PARAMS = ("self", "recv_req", "mm_input_error")
SOURCE_MARKERS = ("self._handle_generate_request(", "recv_req, mm_cleanup, mm_input_error=")
ORIGINAL_ATTR = "__cas_prefix_reuse_original__"
DECODE_MODE = "decode"  # DisaggregationMode.DECODE.value (srt/disaggregation/utils.py:153)


class PrefixReusePatchError(RuntimeError):
    """The SGLang code to hook is not what this patch was written for."""


def check_targets(cls: type) -> list[str]:
    """Problems that forbid patching ``cls`` (empty list: safe to patch)."""
    fn = getattr(cls, HOOK, None)
    if fn is None:
        return [f"{cls.__name__}.{HOOK} is missing"]
    if hasattr(fn, ORIGINAL_ATTR):
        return [f"{cls.__name__}.{HOOK} is already patched"]
    problems = []
    found = tuple(inspect.signature(fn).parameters)
    if found != HOOK_PARAMS:
        problems.append(f"{cls.__name__}.{HOOK}{found} != expected parameters {HOOK_PARAMS}")
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = ""
    problems += [
        f"{cls.__name__}.{HOOK} no longer contains {marker!r}"
        for marker in SOURCE_MARKERS
        if marker not in source
    ]
    return problems


def _default_reporting_rank() -> bool:
    """The first rank of its attention group on the first pipeline stage; unreadable ranks
    (a single-process engine) count as the first."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        ranks = (parallel.attn_tp_rank, parallel.attn_cp_rank, parallel.pp_rank)
        return all(int(rank) == 0 for rank in ranks)
    except (AttributeError, RuntimeError, ValueError):
        return True


def prompt_tokens(recv_req: Any) -> np.ndarray | None:
    """The prompt's token ids as int64 (without a copy for SGLang's ``array('q')``), or None
    when the request has none of its own (``input_embeds``)."""
    if recv_req.input_embeds is not None:
        return None
    ids = recv_req.input_ids
    if ids is None:
        return None
    if isinstance(ids, array) and ids.typecode == "q":
        return np.frombuffer(ids, dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
    return np.asarray(ids, dtype=np.int64)


@dataclass
class PrefixReuseAdapter:
    """The tracker of one scheduler process and whether this process records."""

    tracker: ReuseTracker
    reporting_rank: Callable[[], bool] = _default_reporting_rank
    errors: int = 0
    _records: bool | None = field(default=None, repr=False)

    def records(self, scheduler: Any) -> bool:
        """Decided once per process: not a decode scheduler, and the reporting rank."""
        if self._records is None:
            mode = scheduler.disaggregation_mode.value  # a DisaggregationMode
            self._records = mode != DECODE_MODE and self.reporting_rank()
        return self._records

    def observe(self, scheduler: Any, recv_req: Any, mm_input_error: str | None) -> None:
        if mm_input_error is not None or not self.records(scheduler):
            return
        tokens = prompt_tokens(recv_req)
        if tokens is not None:
            self.tracker.observe(tokens)


@dataclass
class PrefixReusePatch:
    """Handle of an installed patch; :meth:`uninstall` restores the original method."""

    cls: type
    adapter: PrefixReuseAdapter
    original: Callable[..., Any]

    def uninstall(self) -> None:
        setattr(self.cls, HOOK, self.original)


def install_prefix_reuse(
    *,
    metrics: ReuseMetrics | None = None,
    tracker: ReuseTracker | None = None,
    cls: type | None = None,
    reporting_rank: Callable[[], bool] | None = None,
) -> PrefixReusePatch:
    """Wrap ``cls.handle_generate_request`` (default: SGLang's real ``Scheduler``) so every
    received prompt is tracked before SGLang handles it. Raises
    :class:`PrefixReusePatchError` listing every problem when the target does not match."""
    if cls is None:
        import importlib

        cls = getattr(importlib.import_module(TARGET_MODULE), TARGET_CLASS)
    problems = check_targets(cls)
    if problems:
        raise PrefixReusePatchError("cannot install the prefix reuse patch: " + "; ".join(problems))
    adapter = PrefixReuseAdapter(
        tracker=tracker if tracker is not None else ReuseTracker(metrics=metrics),
        reporting_rank=reporting_rank or _default_reporting_rank,
    )
    original = getattr(cls, HOOK)

    def handle_generate_request(
        self: Any, recv_req: Any, *, mm_input_error: str | None = None
    ) -> Any:
        try:
            adapter.observe(self, recv_req, mm_input_error)
        except Exception:  # never break serving because of a metric
            adapter.errors += 1
            if adapter.errors == 1:
                logger.exception("cas prefix reuse: tracking failed; requests go untracked")
        return original(self, recv_req, mm_input_error=mm_input_error)

    setattr(handle_generate_request, "__wrapped__", original)  # noqa: B010 - typed as a function
    setattr(handle_generate_request, ORIGINAL_ATTR, original)
    setattr(cls, HOOK, handle_generate_request)
    logger.info("cas prefix reuse patch installed on %s.%s", cls.__name__, HOOK)
    return PrefixReusePatch(cls, adapter, original)
