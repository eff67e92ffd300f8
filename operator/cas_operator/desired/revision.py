"""Revision: a short hash of every engine-relevant setting of BOTH roles.

A prefill and a decode pod exchange KV and must run the same engine, so a change to either role
makes a new revision for both. Replica counts, router settings, the anomaly guard's operator-side
fields and rollout settings are not part of it: changing them never restarts engines.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cas_operator.api.models import CodingAgentServingSpec

ENGINE_SECTIONS = ("model", "engine", "hicache")
POOL_EXCLUDED = {"replicas"}
GUARD_ENGINE_FIELDS = {"enabled", "min_generated_tokens", "min_accept_length", "max_accept_rate"}


def stable_hash(data: Any, length: int = 8) -> str:
    """Hex digest of canonical JSON; the same data always gives the same hash."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def revision_of(spec: CodingAgentServingSpec) -> str:
    """The revision label value for this spec."""
    data: dict[str, Any] = {k: getattr(spec, k).model_dump(mode="json") for k in ENGINE_SECTIONS}
    data["prefill"] = spec.prefill.model_dump(mode="json", exclude=POOL_EXCLUDED)
    data["decode"] = spec.decode.model_dump(mode="json", exclude=POOL_EXCLUDED)
    data["guard"] = spec.anomaly_guard.model_dump(mode="json", include=GUARD_ENGINE_FIELDS)
    return stable_hash(data)
