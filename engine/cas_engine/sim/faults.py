"""Fault injection settings, parsed from ``--sim-fault`` and changed live by ``POST /sim/fault``.

Ownership: one mutable :class:`Faults` per worker; the scheduler reads it on every decision, the
admin endpoint replaces fields in place. Spec string: comma-separated ``name=value``:

- ``kv_write_stall=P:S``  prefill: with probability P a KV write, once issued, stalls S sim
  seconds before it lands (the in-flight RDMA write of the GLM-5 report's bug 1).
- ``corruption=P``        prefill: with probability P a KV write lands with flipped bytes.
- ``repetition=P``        decode: with probability P a request degenerates into repetition
  (accept rate -> 1, repeated text).
- ``copy=P``              decode: with probability P a request is a verbatim copy of source
  code (healthy: accept rate near 1, text that does not repeat with a short period).
- ``decode_corruption=P`` decode: with probability P a request reads corrupted KV (a decode
  with bad memory: garbled text, draft acceptance collapses).
- ``slow_decode=F``       decode: every step takes F times longer (F >= 1).
- ``slow_prefill=F``      prefill: every batch takes F times longer (F >= 1): a starved
  prefill pool, the skewed P:D ratio of the production report.
- ``crash=1``             the process exits at once (exit code 70).
- ``hang=1``              the scheduler and health endpoints stop answering until cleared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class Faults:
    """Live fault settings (all off by default)."""

    kv_write_stall_rate: float = 0.0
    kv_write_stall_s: float = 0.0
    corruption_rate: float = 0.0
    repetition_rate: float = 0.0
    copy_rate: float = 0.0
    decode_corruption: float = 0.0
    slow_decode: float = 1.0
    slow_prefill: float = 1.0
    crash: bool = False
    hang: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def apply(self, spec: str | dict[str, Any]) -> None:
        """Update from a spec string or a JSON object (same names as the spec string, or the
        field names); raises ValueError on an unknown name or a bad value."""
        items = _spec_items(spec) if isinstance(spec, str) else list(spec.items())
        for name, value in items:
            _set(self, name, value)


def parse_faults(spec: str) -> Faults:
    """A fresh :class:`Faults` from a spec string ('' = no fault)."""
    faults = Faults()
    faults.apply(spec)
    return faults


def _spec_items(spec: str) -> list[tuple[str, str]]:
    items = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"fault {part!r}: expected name=value")
        items.append((name.strip(), value.strip()))
    return items


def _prob(value: Any) -> float:
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability {value!r} outside [0, 1]")
    return p


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def _set(f: Faults, name: str, value: Any) -> None:
    if name == "kv_write_stall":
        rate, _, seconds = str(value).partition(":")
        f.kv_write_stall_rate = _prob(rate)
        f.kv_write_stall_s = float(seconds or 0.0)
    elif name in (
        "kv_write_stall_rate",
        "corruption",
        "corruption_rate",
        "repetition",
        "repetition_rate",
        "copy",
        "copy_rate",
        "decode_corruption",
    ):
        renamed = {"corruption": "corruption_rate", "repetition": "repetition_rate"}
        attr = {**renamed, "copy": "copy_rate"}.get(name, name)
        setattr(f, attr, _prob(value))
    elif name == "kv_write_stall_s":
        f.kv_write_stall_s = max(0.0, float(value))
    elif name in ("slow_decode", "slow_prefill"):
        setattr(f, name, max(1.0, float(value)))
    elif name in ("crash", "hang"):
        setattr(f, name, _flag(value))
    else:
        raise ValueError(f"unknown fault {name!r}")
