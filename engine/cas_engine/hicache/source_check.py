"""Start-up check: do the installed SGLang's DSA/NSA index-cache getters wait for the layer load?

Why: with HiCache, the index cache of layer L is copied host -> device on a load stream while
the forward stream runs; the sparse-attention indexer must not read layer L before that copy
finished. SGLang >= 0.5.11 makes every getter of the DSA index cache wait on the pool's
``layer_transfer_counter`` for that layer. This module verifies it on the installed source
without importing SGLang (no torch, no GPU): it parses the memory-pool modules with ``ast`` and
follows calls from each getter (``self.m()``, ``self.index_key_cache.m()``, base classes) until
it finds ``<...>.layer_transfer_counter.wait_until(...)``.

Data flow: the launcher calls :func:`check_installed_sglang` (or :func:`check_source_tree` on a
given package directory) before starting SGLang with ``--enable-hierarchical-cache``; a failed
:class:`HiCacheVerdict` makes it refuse to start with :attr:`HiCacheVerdict.message`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

MIN_SGLANG_VERSION = "0.5.11"
SOURCE_FILES = ("srt/mem_cache/memory_pool.py", "srt/mem_cache/index_key_cache.py")
DSA_POOL_CLASS = re.compile(r"^(DSA|NSA)TokenToKVPool$")
WRAPPER_CLASSES = ("HybridLinearKVPool",)
GETTER = re.compile(r"^get_(broadcastable_)?index_k\w*buffer$")
# attributes that hold a helper object whose class lives in the parsed files
ATTRIBUTE_TYPES = {"index_key_cache": "IndexKeyCache"}
COUNTER_ATTRS = ("layer_transfer_counter", "layer_done_counter")
MAX_DEPTH = 6


@dataclass(frozen=True)
class HiCacheVerdict:
    """Outcome of the check; ``getters`` maps ``Class.method`` to whether it waits."""

    ok: bool
    sglang_version: str | None
    getters: dict[str, bool] = field(default_factory=dict)
    message: str = ""


@dataclass
class _ClassInfo:
    bases: list[str]
    methods: dict[str, ast.FunctionDef]


def _parse_classes(root: Path) -> dict[str, _ClassInfo]:
    classes: dict[str, _ClassInfo] = {}
    for rel in SOURCE_FILES:
        path = root / rel
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                methods = {
                    f.name: f
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                classes[node.name] = _ClassInfo(bases, methods)  # type: ignore[arg-type]
    return classes


def _resolve(
    classes: dict[str, _ClassInfo], cls: str, name: str
) -> tuple[str, ast.FunctionDef] | None:
    """Find method ``name`` on ``cls`` or its bases (depth-first, parsed classes only)."""
    seen: set[str] = set()
    stack = [cls]
    while stack:
        current = stack.pop(0)
        if current in seen or current not in classes:
            continue
        seen.add(current)
        info = classes[current]
        if name in info.methods:
            return current, info.methods[name]
        stack.extend(info.bases)
    return None


def _is_counter_wait(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in {"wait_until", "wait"}
        and isinstance(func.value, ast.Attribute)
        and func.value.attr in COUNTER_ATTRS
    )


def _callee(call: ast.Call, cls: str) -> tuple[str, str] | None:
    """(class, method) for ``self.m(...)`` and ``self.<known attr>.m(...)`` calls."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    target = func.value
    if isinstance(target, ast.Name) and target.id == "self":
        return cls, func.attr
    if (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
        and target.attr in ATTRIBUTE_TYPES
    ):
        return ATTRIBUTE_TYPES[target.attr], func.attr
    return None


def _waits(
    classes: dict[str, _ClassInfo],
    cls: str,
    method: str,
    depth: int = 0,
    seen: set[tuple[str, str]] | None = None,
) -> bool:
    seen = set() if seen is None else seen
    found = _resolve(classes, cls, method)
    if found is None or depth > MAX_DEPTH or (found[0], method) in seen:
        return False
    owner, fn = found
    seen.add((owner, method))
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        if _is_counter_wait(node):
            return True
        callee = _callee(node, cls if owner == cls else owner)
        if callee is not None and _waits(classes, callee[0], callee[1], depth + 1, seen):
            return True
    return False


def _required_getters(classes: dict[str, _ClassInfo]) -> list[tuple[str, str]]:
    wanted = [c for c in classes if DSA_POOL_CLASS.match(c)]
    wanted += [c for c in WRAPPER_CLASSES if c in classes]
    return [(c, m) for c in wanted for m in classes[c].methods if GETTER.match(m)]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def check_source_tree(root: Path, version: str | None = None) -> HiCacheVerdict:
    """Check the SGLang package directory ``root`` (the folder holding ``srt/``)."""
    classes = _parse_classes(root)
    getters = {f"{c}.{m}": _waits(classes, c, m) for c, m in _required_getters(classes)}
    need = f"sglang >= {MIN_SGLANG_VERSION} (the engine image pins a version that has it)"
    if not any(DSA_POOL_CLASS.match(c) for c in classes):
        return HiCacheVerdict(
            False,
            version,
            getters,
            f"no DSA/NSA token-to-KV pool found under {root}; cannot verify "
            f"HiCache load ordering; need {need}",
        )
    missing = sorted(name for name, ok in getters.items() if not ok)
    if not getters or missing:
        return HiCacheVerdict(
            False,
            version,
            getters,
            "HiCache load-use ordering NOT guaranteed: index-cache getter(s) "
            f"{missing or '(none found)'} do not wait for the layer load; "
            f"disable HiCache or use {need}",
        )
    if version is not None and _version_tuple(version) < _version_tuple(MIN_SGLANG_VERSION):
        return HiCacheVerdict(
            False,
            version,
            getters,
            f"sglang {version} is older than {MIN_SGLANG_VERSION}; need {need}",
        )
    return HiCacheVerdict(
        True,
        version,
        getters,
        f"HiCache load-use ordering ok: {len(getters)} DSA index-cache "
        f"getter(s) wait for the layer load (sglang {version or 'unknown'})",
    )


def installed_sglang_root() -> Path | None:
    """Directory of the installed ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def check_installed_sglang() -> HiCacheVerdict:
    """Run :func:`check_source_tree` on the installed SGLang."""
    root = installed_sglang_root()
    if root is None:
        return HiCacheVerdict(False, None, {}, "sglang is not installed")
    try:
        version: str | None = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return check_source_tree(root, version)
