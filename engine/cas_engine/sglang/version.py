"""The SGLang version the engine adapters are written against, and a fail-fast check.

Every adapter in ``cas_engine.sglang`` patches functions of exactly this release; running them
on another one could hook code whose meaning changed. :func:`require_sglang` is called before
any patch is applied (minimal version; the kvfence owner may extend it).
"""

from __future__ import annotations

import importlib.metadata

PINNED_SGLANG_VERSION = "0.5.23"


class SGLangVersionError(RuntimeError):
    """The installed SGLang is missing or is not the pinned release."""


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_sglang(pinned: str = PINNED_SGLANG_VERSION) -> str:
    """Return the installed version if it equals ``pinned``; raise otherwise."""
    found = installed_sglang_version()
    if found is None:
        raise SGLangVersionError(f"sglang is not installed; cas_engine needs sglang=={pinned}")
    if found != pinned:
        raise SGLangVersionError(
            f"sglang {found} is installed but cas_engine's patches are written for "
            f"sglang=={pinned}; install that version (the engine image pins it)"
        )
    return found
