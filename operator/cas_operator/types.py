"""Types and time formats shared by every loop, defined once.

`Manifest` is a Kubernetes object as a JSON dict (what the API client sends and returns);
`Status` a resource's `.status` (or a part of it); `Event` an event to post on a resource.
Times on the API are RFC 3339 in UTC with second precision (`rfc3339`, `parse_time`).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

Manifest = dict[str, Any]
Status = dict[str, Any]
Event = tuple[str, str, str]  # (type, reason, message), posted on the custom resource


def rfc3339(epoch: float | None = None) -> str:
    """`epoch` (default: now) as the API server writes times: `2026-12-01T18:52:08Z`."""
    moment = time.time() if epoch is None else epoch
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 time; None when absent or unreadable."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
