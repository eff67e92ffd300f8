"""Guard configuration: thresholds, window and minimum tokens.

Data flow: the operator renders the resource's ``anomalyGuard`` values as ``--cas-guard-*``
flags (or ``CAS_GUARD_*`` environment variables) on the engine pod; the launcher parses them
into one frozen :class:`GuardConfig` that the monitor owns for its lifetime. Precedence:
explicit CLI flag > environment variable > default.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace

ENV_PREFIX = "CAS_GUARD_"


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """Thresholds of the speculative-decoding quality gate.

    - ``min_generated_tokens``: a request is judged only once it has generated MORE than this.
    - ``min_accept_length``: trip ``low_accept_length`` below this (tokens per verify step,
      bonus token included, as SGLang's ``spec_accept_length``).
    - ``max_accept_rate``: trip ``high_accept_rate`` above this (accepted / proposed drafts).
    - ``window``: number of recent speculative verify steps in the windowed statistics;
      0 disables the windowed check (cumulative statistics only).
    - ``enabled``: False keeps the statistics and metrics but never trips (observe mode).
    - ``repetition_period``: ``high_accept_rate`` trips only when the request's own output
      also repeats with a period of at most this many tokens (`guard.repetition`): a verbatim
      copy of a file accepts nearly every draft too, without repeating. 0 = the rate alone
      (also what a caller that cannot supply the tokens gets).
    """

    min_generated_tokens: int = 128
    min_accept_length: float = 1.4
    max_accept_rate: float = 0.96
    window: int = 32
    enabled: bool = True
    repetition_period: int = 48

    def __post_init__(self) -> None:
        if self.min_generated_tokens < 0:
            raise ValueError("min_generated_tokens must be >= 0")
        if not (math.isfinite(self.min_accept_length) and self.min_accept_length >= 0):
            raise ValueError("min_accept_length must be a finite number >= 0")
        if not (math.isfinite(self.max_accept_rate) and 0 <= self.max_accept_rate <= 1):
            raise ValueError("max_accept_rate must be within [0, 1]")
        if self.window < 0:
            raise ValueError("window must be >= 0")
        if self.repetition_period < 0:
            raise ValueError("repetition_period must be >= 0")

    def as_labels(self) -> dict[str, str]:
        """String form for the ``cas_guard_config`` info metric."""
        return {
            k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in asdict(self).items()
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GuardConfig:
        """Read ``CAS_GUARD_<FIELD>`` variables (e.g. ``CAS_GUARD_MIN_ACCEPT_LENGTH``)."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw.strip() != "":
                values[f.name] = _parse_value(f.name, raw)
        return cls(**values)  # type: ignore[arg-type]


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"not a boolean: {raw!r}")


_PARSERS: dict[str, Callable[[str], object]] = {
    "min_generated_tokens": int,
    "min_accept_length": float,
    "max_accept_rate": float,
    "window": int,
    "enabled": _parse_bool,
    "repetition_period": int,
}


def _parse_value(name: str, raw: str) -> object:
    try:
        return _PARSERS[name](raw.strip())
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: {exc}") from exc


def add_guard_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--cas-guard-*`` flags; every default is None so the environment can fill in."""
    group = parser.add_argument_group("cas quality gate (speculative decoding)")
    d = GuardConfig()
    group.add_argument(
        "--cas-guard-min-generated-tokens",
        type=int,
        default=None,
        help=f"judge a request only after more than N tokens (default {d.min_generated_tokens})",
    )
    group.add_argument(
        "--cas-guard-min-accept-length",
        type=float,
        default=None,
        help=f"trip below this accept length (default {d.min_accept_length})",
    )
    group.add_argument(
        "--cas-guard-max-accept-rate",
        type=float,
        default=None,
        help=f"trip above this accept rate (default {d.max_accept_rate})",
    )
    group.add_argument(
        "--cas-guard-window",
        type=int,
        default=None,
        help=f"recent verify steps in the windowed check, 0 = off (default {d.window})",
    )
    group.add_argument(
        "--cas-guard-repetition-period",
        type=int,
        default=None,
        help="trip on a high accept rate only when the output repeats with at most this "
        f"period, 0 = on the rate alone (default {d.repetition_period})",
    )
    group.add_argument(
        "--cas-guard-enabled",
        type=_parse_bool,
        default=None,
        metavar="BOOL",
        help="false = observe only, never abort (default true)",
    )


def guard_config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> GuardConfig:
    """Combine parsed ``--cas-guard-*`` flags with the environment (flags win)."""
    base = GuardConfig.from_env(env)
    overrides = {
        f.name: getattr(args, "cas_guard_" + f.name)
        for f in fields(GuardConfig)
        if getattr(args, "cas_guard_" + f.name, None) is not None
    }
    return replace(base, **overrides)
