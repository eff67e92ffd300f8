"""Strict KV reclaim for SGLang's decode side (pinned SGLang 0.5.23).

What upstream does: an aborted or failed transfer whose prefill ranks may still write is held in
``DecodeTransferQueue._deferred_releases``; ``resolve_deferred_releases`` frees a GPU-resident
entry once every prefill rank acknowledged the abort (``kv_mgr.is_abort_release_safe``) OR once
``deferred_kv_release_timeout`` (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``,
30 s) has passed, which reopens the race for a stalled write (DESIGN.md, Bug 1).

What this adapter changes (minimal, no upstream code copied):

1. ``DecodeTransferQueue.__init__`` is wrapped: after it ran, the queue's timeout becomes
   ``math.inf``, so the deadline ``_defer_release`` computes (``start_time + timeout``) is never
   reached and ``resolve_deferred_releases`` releases device destinations only when drained,
   exactly like it already does for host destinations. The upstream timeout is kept as the
   "overdue" threshold for logging. It refuses to start when deferred release is disabled
   (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0``), since then nothing is held at all.
2. ``DecodeTransferQueue.resolve_deferred_releases`` is wrapped to observe the held entries:
   ``cas_kv_quarantined_rooms``, ``cas_kv_reclaims_total{outcome="acked"}``, the reclaim wait
   histogram, a warning per room once it is overdue, and :meth:`StrictReclaimPatch.health`,
   which turns unhealthy when more rooms are held than ``quarantine_budget_rooms``.

Before patching, :func:`check_decode_queue` verifies the SGLang version, that the methods exist
and that their source still contains the lines this reasoning depends on; any mismatch raises
:class:`StrictReclaimError` with the reason, and the launcher refuses to start.
:func:`require_deferred_capable_backend` refuses transfer backends whose KV manager does not
defer the release of aborted transfers (read from SGLang's source; mooncake, nixl and mori do).

Not covered (yet): source-page pinning on the prefill side. In 0.5.23 the prefill frees a
failed room's pages in ``handle_inflight_transfer_failure`` while ``_staging_outstanding`` may
still count an in-flight chunk; holding them needs a flag all-reduced over the TP/CP group
(polls are MIN-reduced, so one rank cannot hold alone). The writes of such a room land only in
decode pages that strict mode keeps quarantined, so the decode side's guarantee holds.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from cas_engine.kvfence.metrics import KvFenceMetrics
from cas_engine.sglang.version import SGLangVersionError, require_sglang

log = logging.getLogger(__name__)

DECODE_MODULE = "sglang.srt.disaggregation.decode"
DECODE_CLASS = "DecodeTransferQueue"
ENABLE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"

# Method -> source lines of SGLang 0.5.23 the patch relies on.
FINGERPRINTS: dict[str, tuple[str, ...]] = {
    "__init__": ("self.deferred_kv_release_timeout = (", "self._deferred_releases"),
    "_defer_release": ("deadline = start_time + self.deferred_kv_release_timeout",),
    "resolve_deferred_releases": (
        "is_ready = is_drained or now >= deadline",
        "is_abort_release_safe(",
        "self._deferred_releases = still_held",
    ),
    "_do_release": ("clear_deferred_abort_state(",),
}

_MARK = "_cas_strict_reclaim"


class StrictReclaimError(RuntimeError):
    """The SGLang in this image is not the one the strict-reclaim patch was written for."""


def strict_env() -> dict[str, str]:
    """Environment the launcher sets before SGLang reads it: deferred release must be on."""
    return {ENABLE_ENV: "1"}


def check_decode_queue(cls: type) -> None:
    """Raise :class:`StrictReclaimError` unless ``cls`` has the methods and lines we patch."""
    for name, lines in FINGERPRINTS.items():
        method = cls.__dict__.get(name)
        if method is None:
            raise StrictReclaimError(
                f"{cls.__name__}.{name} is missing; strict KV reclaim "
                "cannot be applied to this SGLang"
            )
        method = getattr(method, "__wrapped__", method)
        try:
            source = inspect.getsource(method)
        except (OSError, TypeError) as exc:
            raise StrictReclaimError(
                f"cannot read the source of {cls.__name__}.{name}: {exc}"
            ) from exc
        for line in lines:
            if line not in source:
                raise StrictReclaimError(
                    f"{cls.__name__}.{name} no longer contains {line!r}; its deferred-release "
                    "logic changed, so the strict patch would be unsound. Re-check the patch "
                    "against this SGLang version."
                )


def backend_supports_deferred_release(backend: str) -> bool:
    """Whether SGLang's ``backend`` KV manager holds failed transfers for deferred release.

    Read from the installed source (no import, so it works without torch): a backend whose
    manager does not set ``supports_deferred_decode_kv_release = True`` frees an aborted
    transfer's KV at once, and strict reclaim cannot be enforced on top of it.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise StrictReclaimError("sglang is not installed")
    conn = Path(spec.origin).parent / "srt" / "disaggregation" / backend / "conn.py"
    if not backend.isidentifier() or not conn.is_file():
        raise StrictReclaimError(f"unknown SGLang transfer backend {backend!r}")
    for node in ast.walk(ast.parse(conn.read_text(), filename=str(conn))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if "supports_deferred_decode_kv_release" in names and node.value.value is True:
                return True
    return False


def require_deferred_capable_backend(backend: str) -> None:
    """Refuse strict mode on a transfer backend that cannot hold aborted transfers."""
    if not backend_supports_deferred_release(backend):
        raise StrictReclaimError(
            f"--disaggregation-transfer-backend {backend} releases aborted transfers at once; "
            "strict KV reclaim needs a backend with deferred release (mooncake, nixl, mori)"
        )


def load_decode_queue_class() -> type:
    """Import the pinned SGLang's ``DecodeTransferQueue`` (version-checked)."""
    try:
        require_sglang()
    except SGLangVersionError as exc:
        raise StrictReclaimError(str(exc)) from exc
    try:
        module = importlib.import_module(DECODE_MODULE)
    except ImportError as exc:
        raise StrictReclaimError(f"cannot import {DECODE_MODULE}: {exc}") from exc
    cls = getattr(module, DECODE_CLASS, None)
    if not isinstance(cls, type):
        raise StrictReclaimError(f"{DECODE_MODULE}.{DECODE_CLASS} not found")
    return cls


@dataclass
class StrictReclaimPatch:
    """State of an installed patch: what it observed in the last resolve pass."""

    quarantine_budget_rooms: int | None
    metrics: KvFenceMetrics
    rooms_gauge: Gauge
    clock: Callable[[], float] = time.monotonic
    held_rooms: int = 0
    overdue_rooms: int = 0
    _warned: set[int] = field(default_factory=set)

    def health(self) -> tuple[bool, str]:
        """False while more rooms are held than the budget allows (the operator drains)."""
        budget = self.quarantine_budget_rooms
        if budget is None or self.held_rooms <= budget:
            return True, ""
        return False, (
            f"KV quarantine: {self.held_rooms} aborted rooms held awaiting prefill "
            f"abort acks (budget {budget}, {self.overdue_rooms} past the upstream "
            "timeout); reuse is not provably safe, drain this pod"
        )

    def observe(self, queue: Any, before: list[tuple[Any, ...]]) -> None:
        """Account releases and held rooms after one ``resolve_deferred_releases`` pass."""
        now = self.clock()
        held = queue._deferred_releases
        held_ids = {id(entry[0]) for entry in held}
        for entry in before:
            if id(entry[0]) not in held_ids:
                self.metrics.reclaims.labels(outcome="acked").inc()
                self.metrics.reclaim_wait.observe(max(0.0, now - entry[1]))
                self._warned.discard(id(entry[0]))
        overdue_s = getattr(queue, "_cas_upstream_timeout_s", math.inf)
        overdue = [e for e in held if now - e[1] >= overdue_s]
        for entry in overdue:
            if id(entry[0]) not in self._warned:
                self._warned.add(id(entry[0]))
                log.warning(
                    "strict KV reclaim: room %s still held %.0f s after abort, waiting "
                    "for every prefill rank's ack (upstream would release it now)",
                    getattr(entry[0].req, "bootstrap_room", "?"),
                    now - entry[1],
                )
        self.held_rooms, self.overdue_rooms = len(held), len(overdue)
        self.rooms_gauge.set(len(held))
        self.metrics.unhealthy.set(0.0 if self.health()[0] else 1.0)


def install_strict_reclaim(
    cls: type | None = None,
    *,
    quarantine_budget_rooms: int | None = None,
    metrics: KvFenceMetrics | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StrictReclaimPatch:
    """Patch ``cls`` (default: the pinned SGLang's DecodeTransferQueue). Idempotent."""
    cls = cls if cls is not None else load_decode_queue_class()
    existing = cls.__dict__.get(_MARK)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    check_decode_queue(cls)
    metrics = metrics if metrics is not None else KvFenceMetrics()
    patch = StrictReclaimPatch(
        quarantine_budget_rooms=quarantine_budget_rooms,
        metrics=metrics,
        clock=clock,
        rooms_gauge=Gauge(
            "cas_kv_quarantined_rooms",
            "SGLang decode requests held for deferred KV release",
            registry=metrics.registry,
        ),
    )
    _wrap_init(cls)
    _wrap_resolve(cls, patch)
    setattr(cls, _MARK, patch)
    log.info("strict KV reclaim installed on %s.%s", cls.__module__, cls.__name__)
    return patch


def _wrap_init(cls: type) -> None:
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not self.enable_deferred_kv_release:
            raise StrictReclaimError(
                f"strict KV reclaim needs {ENABLE_ENV}=1 (deferred release is off, so aborted "
                "transfers would free their KV at once)"
            )
        self._cas_upstream_timeout_s = self.deferred_kv_release_timeout
        self.deferred_kv_release_timeout = math.inf

    cls.__init__ = __init__  # type: ignore[misc]


def _wrap_resolve(cls: type, patch: StrictReclaimPatch) -> None:
    original = cls.resolve_deferred_releases  # type: ignore[attr-defined]

    @functools.wraps(original)
    def resolve_deferred_releases(self: Any) -> None:
        before = list(self._deferred_releases)
        original(self)
        patch.observe(self, before)

    cls.resolve_deferred_releases = resolve_deferred_releases  # type: ignore[attr-defined]


def apply_env_defaults(environ: dict[str, str] | None = None) -> None:
    """Set :func:`strict_env` in ``environ`` (default ``os.environ``) unless set otherwise."""
    env = os.environ if environ is None else environ
    for key, value in strict_env().items():
        env.setdefault(key, value)
