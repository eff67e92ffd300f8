"""Import check shared by the tests that run real SGLang code (marker ``sglang_real``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys


def sglang_import_problem(*modules: str) -> str | None:
    """None when torch, sglang and ``modules`` import; else why not (the skip reason).

    A failed import leaves half-imported ``sglang.*`` entries in ``sys.modules`` that break
    later imports with a confusing ``KeyError``; they are dropped here.
    """
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sglang") is None:
        return "torch or sglang not installed (make setup installs them)"
    before = set(sys.modules)
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as exc:  # a missing dependency of SGLang's: report it as the reason
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]
        return f"sglang does not import here: {type(exc).__name__}: {exc}"
    return None
