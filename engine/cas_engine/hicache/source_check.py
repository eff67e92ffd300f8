"""Start-up check: does every HiCache-visible getter of every DSA/indexer pool wait for the load?

Why: with HiCache, layer L's KV and DSA index cache are copied host -> device on a load stream
while the forward stream runs; nothing may read layer L on the device before that copy is
ordered. SGLang orders it with ``<pool>.layer_transfer_counter.wait_until(L)``
(``LayerDoneCounter.wait_until`` -> ``current_stream().wait_event(load_events[L])``,
sglang/srt/managers/cache_controller.py:75-105). This module proves, from the source text alone
(``ast``, no import of SGLang, no torch), that on every path of every getter the wait for *that
getter's layer* comes before the first read of the buffer, and names the getter where it does
not.

The analysis (per getter, per pool class, with ``self`` bound to that class, so overrides and
``super()`` follow the real MRO):

- a path's state is CLEAN (nothing yet), WAITED (the counter wait for this layer ran) or READ
  (something read the buffer first: a violation, with its file:line);
- a *wait* is ``<...>.layer_transfer_counter.wait_until(...)`` reached in the getter or in a
  ``self``-method / ``self.index_key_cache`` / ``self.pool`` callee that is handed the getter's
  own layer (a wait for ``layer_id + 1`` does not order a read of ``layer_id``);
- a *read* is GPU work on a buffer: the getter's own ``return <tensor>`` (its caller reads it on
  the current stream), a copy/broadcast/gather/kernel call (``copy_``, ``broadcast``,
  ``all_gather``, ``index_select``, ``execute``...), or a getter call on another object
  (``self.full_kv_pool.get_...``: the inner pool's counter is None under a wrapper, so its
  own wait does not count);
- ``if <self counter> is not None:`` runs its body only (no counter: HiCache is off); every
  other ``if`` forks the path, loops run zero or one time, ``raise`` ends a path without a read.

Which classes: :func:`pool_classes` enumerates them from the parsed code: ``DSATokenToKVPool``
and every subclass (layer split, page interleave, HiSparse...), plus every other ``KVCache``
descendant with an index-cache getter (``HybridLinearKVPool``, ``SWAKVPool``,
``DeepSeekV4TokenToKVPool``, ``MiniMaxSparseKVPool``), minus :data:`INNER_POOLS` (held and
waited for by a wrapper, never given a counter). A class with an index getter that this rule
cannot place makes the check fail. The layer-ahead prefetchers (``prefetch_kv_buffer``,
``_prefetch_layer``) are checked like getters, for the layer they prefetch.

Gaps that cas_engine closes at run time (:mod:`cas_engine.sglang.hicache_check` installs the
patches in every SGLang process) are listed in :data:`PATCHED` and do not fail the verdict; any
other gap does. Entry points: :func:`check_sources` (a mapping ``relative path -> source text``,
so a test can feed a mutated copy), :func:`check_source_tree` (a package directory) and
:func:`check_installed_sglang` (the launcher's pre-flight, before ``--enable-hierarchical-cache``).
What this cannot prove (stream semantics, a wait on one stream and the read on another, call
order across getters): see docs/engine.md, "HiCache".
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

MIN_SGLANG_VERSION = "0.5.11"
# every module that defines a DSA/indexer pool, its index-key cache or a wrapper around them
# (`grep -rn "def get_\w*index" srt/mem_cache srt/layers/cp` in 0.5.23; layers/cp defines none)
SOURCE_FILES = (
    "srt/mem_cache/memory_pool.py",
    "srt/mem_cache/index_key_cache.py",
    "srt/mem_cache/dsa_cache_layer_split.py",
    "srt/mem_cache/page_interleave_pool.py",
    "srt/mem_cache/hisparse_memory_pool.py",
    "srt/mem_cache/base_swa_memory_pool.py",
    "srt/mem_cache/swa_memory_pool.py",
    "srt/mem_cache/deepseek_v4_memory_pool.py",
)
DSA_BASE = "DSATokenToKVPool"
KV_BASE = "KVCache"
INDEX_GETTER = re.compile(r"^get_(broadcastable_|low_ratio_)?index_k\w*$")
NOT_GETTERS = frozenset({"get_index_k_page_size", "get_index_k_state_buf_infos"})
KV_GETTERS = ("get_key_buffer", "get_value_buffer", "get_kv_buffer", "get_mla_kv_buffer")
PREFETCHERS = ("prefetch_kv_buffer", "_prefetch_layer")
INNER_POOLS = {
    # deepseek_v4_memory_pool.py: instances live only in DeepSeekV4TokenToKVPool.index_pools and
    # are never registered with a counter (no register_layer_transfer_counter in the module); the
    # wrapper's getters wait first (wait_layer_transfer, deepseek_v4_memory_pool.py:1848)
    "DeepSeekV4IndexerPool": "read only through DeepSeekV4TokenToKVPool, which waits",
}
# gaps of upstream's code that cas_engine.sglang.hicache_check closes at run time
PATCHED = {
    "LayerSplitDSATokenToKVPool.prefetch_kv_buffer": "cas layer-split prefetch ordering",
    "SWAKVPool.get_index_k_with_scale_buffer": "cas SWA index-getter wait",
    "SWAKVPool.get_index_k_scale_buffer": "cas SWA index-getter wait",
}
COUNTER_ATTRS = ("layer_transfer_counter",)
HELPER_ATTRS = ("index_key_cache",)  # helper objects that share the pool's counter
READ_OPS = frozenset(
    {"copy_", "broadcast", "all_gather", "index_select", "execute", "clone", "index_copy_"}
)
KERNEL_NAME = re.compile(r"(triton|dequant|gather|kernel)")
MAX_DEPTH = 8
# `if self.<attr>:` whose false branch has no HiCache-loaded rows to order: the page-interleave
# scratch holds loaded prefix pages only when `_block_pages` > 0 (page_interleave_pool.py:545-553;
# without a prefix the scratch holds this batch's own chunk writes)
NO_LOAD_GUARDS = ("_block_pages",)

State = tuple[str, ...]  # CLEAN, WAITED, or ("read", where): one path's state
CLEAN: State = ("clean",)
WAITED: State = ("waited",)


@dataclass(frozen=True)
class HiCacheVerdict:
    """Outcome of the check.

    ``getters`` maps ``Class.method`` to True when the wait precedes every read on every path
    (or cas_engine patches the gap, see ``patched``); ``problems`` maps each failing or patched
    getter to where the first unordered read is.
    """

    ok: bool
    sglang_version: str | None
    getters: dict[str, bool] = field(default_factory=dict)
    message: str = ""
    problems: dict[str, str] = field(default_factory=dict)
    patched: dict[str, str] = field(default_factory=dict)
    pools: tuple[str, ...] = ()


@dataclass
class _ClassInfo:
    name: str
    path: str
    bases: list[str]
    methods: dict[str, ast.FunctionDef]


@dataclass(frozen=True)
class _Ctx:
    """Who ``self`` is: the class whose method runs and the pool it belongs to."""

    cls: str  # concrete class of `self` (a pool, or its index-key cache)
    pool: str  # the pool (same as cls for pool methods)
    same_layer: bool  # the callee works on the getter's own layer


def parse_classes(sources: Mapping[str, str]) -> dict[str, _ClassInfo]:
    classes: dict[str, _ClassInfo] = {}
    for rel, text in sources.items():
        tree = ast.parse(text, filename=rel)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                methods = {
                    f.name: f
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                classes[node.name] = _ClassInfo(node.name, rel, bases, methods)  # type: ignore[arg-type]
    return classes


def _mro(classes: dict[str, _ClassInfo], cls: str) -> list[str]:
    """C3 linearisation over the parsed classes (unknown bases drop out)."""
    if cls not in classes:
        return []
    seqs = [_mro(classes, b) for b in classes[cls].bases if b in classes]
    seqs.append([b for b in classes[cls].bases if b in classes])
    out = [cls]
    while any(seqs):
        seqs = [s for s in seqs if s]
        for seq in seqs:
            head = seq[0]
            if not any(head in s[1:] for s in seqs):
                break
        else:  # inconsistent hierarchy: fall back to depth-first order
            head = seqs[0][0]
        out.append(head)
        seqs = [[x for x in s if x != head] for s in seqs]
    return out


def _resolve(
    classes: dict[str, _ClassInfo], cls: str, name: str, after: str | None = None
) -> tuple[str, ast.FunctionDef] | None:
    mro = _mro(classes, cls)
    if after is not None:
        mro = mro[mro.index(after) + 1 :] if after in mro else []
    for c in mro:
        if name in classes[c].methods:
            return c, classes[c].methods[name]
    return None


def _guards_no_load(chain: list[str] | None) -> bool:
    """`if self.<attr>:` with an attribute that is false when no rows were loaded."""
    return (
        chain is not None and len(chain) == 2 and chain[0] == "self" and chain[1] in NO_LOAD_GUARDS
    )


def _attr_chain(node: ast.AST) -> list[str] | None:
    """``self.a.b`` -> ["self", "a", "b"]; None unless rooted at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _is_counter_wait(call: ast.Call) -> bool:
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "wait_until"):
        return False
    chain = _attr_chain(func.value)
    return chain is not None and chain[-1] in COUNTER_ATTRS


def _is_counter_guard(test: ast.expr) -> bool:
    """``if self[.pool].layer_transfer_counter is not None [and ...]:``."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    for part in parts:
        if (
            isinstance(part, ast.Compare)
            and len(part.ops) == 1
            and isinstance(part.ops[0], ast.IsNot)
            and isinstance(part.comparators[0], ast.Constant)
            and part.comparators[0].value is None
        ):
            chain = _attr_chain(part.left)
            if chain and chain[0] == "self" and chain[-1] in COUNTER_ATTRS:
                return True
    return False


LAYER_PARAMS = ("layer_id", "layer", "local_layer", "layer_idx")


def _layer_param(fn: ast.FunctionDef) -> str | None:
    """The parameter naming the layer a method works on (None: it has none)."""
    names = [a.arg for a in fn.args.args[1:]]
    return next((n for n in LAYER_PARAMS if n in names), None)


def _layer_aliases(fn: ast.FunctionDef) -> set[str]:
    """The layer parameter and locals bound to ``<layer param>.layer_id``."""
    param = _layer_param(fn)
    if param is None:
        return set()
    out = {param}
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and _attr_chain(node.value) == [param, "layer_id"]
        ):
            out.add(node.targets[0].id)
    return out


class _Analyzer:
    def __init__(self, classes: dict[str, _ClassInfo]) -> None:
        self.classes = classes
        self.stack: list[tuple[str, str, str, bool]] = []

    # ---- helpers -------------------------------------------------------------------------

    def helper_class(self, pool: str) -> str:
        """Class of ``pool.index_key_cache``: what ``_create_index_key_cache`` returns."""
        found = _resolve(self.classes, pool, "_create_index_key_cache")
        if found is not None:
            for node in ast.walk(found[1]):
                if (
                    isinstance(node, ast.Return)
                    and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name)
                ):
                    return node.value.func.id
        return "IndexKeyCache"

    def _passes_layer(
        self, call: ast.Call, callee: ast.FunctionDef, caller: ast.FunctionDef
    ) -> bool | None:
        """Does this call hand the callee the caller's own layer? None: callee takes no layer."""
        want = _layer_param(callee)
        if want is None:
            return None
        aliases = _layer_aliases(caller)
        params = [a.arg for a in callee.args.args[1:]]
        arg: ast.expr | None = next((k.value for k in call.keywords if k.arg == want), None)
        idx = params.index(want)
        if arg is None and idx < len(call.args):
            arg = call.args[idx]
        if arg is None or not aliases:
            return False
        if isinstance(arg, ast.Name):
            return arg.id in aliases
        chain = _attr_chain(arg)  # `layer.layer_id` passed on from a `layer` parameter
        return (
            chain is not None and len(chain) == 2 and chain[0] in aliases and chain[1] == "layer_id"
        )

    # ---- the abstract interpreter --------------------------------------------------------

    def method(self, ctx: _Ctx, owner: str, fn: ast.FunctionDef, top: bool) -> set[State]:
        """Path states at the exits of ``fn`` entered CLEAN (raising paths dropped)."""
        key = (ctx.cls, owner, fn.name, ctx.same_layer)
        if key in self.stack or len(self.stack) > MAX_DEPTH:
            return {CLEAN}
        self.stack.append(key)
        try:
            out, returned = self._block(fn.body, {CLEAN}, ctx, owner, fn, top)
            return out | returned
        finally:
            self.stack.pop()

    def _block(
        self,
        stmts: list[ast.stmt],
        states: set[State],
        ctx: _Ctx,
        owner: str,
        fn: ast.FunctionDef,
        top: bool,
    ) -> tuple[set[State], set[State]]:
        returned: set[State] = set()
        for stmt in stmts:
            if not states:
                break
            states, ret = self._stmt(stmt, states, ctx, owner, fn, top)
            returned |= ret
        return states, returned

    def _stmt(
        self,
        stmt: ast.stmt,
        states: set[State],
        ctx: _Ctx,
        owner: str,
        fn: ast.FunctionDef,
        top: bool,
    ) -> tuple[set[State], set[State]]:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return states, set()
        if isinstance(stmt, ast.Return):
            if stmt.value is not None:
                states = self._expr(stmt.value, states, ctx, owner, fn)
                if top and not (isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
                    states = self._read(states, owner, stmt, "returned to the caller")
            return set(), states
        if isinstance(stmt, ast.Raise):
            return set(), set()
        if isinstance(stmt, ast.If):
            states = self._expr(stmt.test, states, ctx, owner, fn)
            body, r1 = self._block(stmt.body, set(states), ctx, owner, fn, top)
            if _is_counter_guard(stmt.test) or (
                not stmt.orelse and _guards_no_load(_attr_chain(stmt.test))
            ):
                return body, r1  # no counter (HiCache off) or no loaded rows: nothing to order
            other, r2 = self._block(stmt.orelse, set(states), ctx, owner, fn, top)
            return body | other, r1 | r2
        if isinstance(stmt, ast.For | ast.AsyncFor | ast.While):
            head = stmt.iter if isinstance(stmt, ast.For | ast.AsyncFor) else stmt.test
            states = self._expr(head, states, ctx, owner, fn)
            body, r1 = self._block(stmt.body, set(states), ctx, owner, fn, top)
            other, r2 = self._block(stmt.orelse, states | body, ctx, owner, fn, top)
            return other, r1 | r2
        if isinstance(stmt, ast.With | ast.AsyncWith):
            for item in stmt.items:
                states = self._expr(item.context_expr, states, ctx, owner, fn)
            return self._block(stmt.body, states, ctx, owner, fn, top)
        if isinstance(stmt, ast.Try):
            body, r1 = self._block(stmt.body, set(states), ctx, owner, fn, top)
            out, ret = set(body), set(r1)
            for handler in stmt.handlers:
                h, r = self._block(handler.body, states | body, ctx, owner, fn, top)
                out |= h
                ret |= r
            if stmt.orelse:
                out, r = self._block(stmt.orelse, out, ctx, owner, fn, top)
                ret |= r
            if stmt.finalbody:
                out, r = self._block(stmt.finalbody, out, ctx, owner, fn, top)
                ret |= r
            return out, ret
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.expr):
                states = self._expr(child, states, ctx, owner, fn)
        return states, set()

    def _read(self, states: set[State], owner: str, node: ast.AST, what: str) -> set[State]:
        path = self.classes[owner].path if owner in self.classes else "?"
        where = ("read", f"{owner}.{path}:{getattr(node, 'lineno', '?')} ({what})")
        return {where if s == CLEAN else s for s in states}

    def _expr(
        self, node: ast.expr, states: set[State], ctx: _Ctx, owner: str, fn: ast.FunctionDef
    ) -> set[State]:
        """Evaluate ``node`` in (approximately) Python's order; calls after their arguments."""
        if isinstance(node, ast.Lambda):
            return states
        if not isinstance(node, ast.Call):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    states = self._expr(child, states, ctx, owner, fn)
            return states
        if isinstance(node.func, ast.Attribute):
            states = self._expr(node.func.value, states, ctx, owner, fn)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            states = self._expr(arg, states, ctx, owner, fn)
        return self._call(node, states, ctx, owner, fn)

    def _call(
        self, call: ast.Call, states: set[State], ctx: _Ctx, owner: str, fn: ast.FunctionDef
    ) -> set[State]:
        if _is_counter_wait(call):
            if not ctx.same_layer:
                return states  # a wait for another layer orders nothing here
            return {WAITED if s == CLEAN else s for s in states}
        func = call.func
        if isinstance(func, ast.Name):
            if KERNEL_NAME.search(func.id):
                return self._read(states, owner, call, f"{func.id}()")
            return states
        if not isinstance(func, ast.Attribute):
            return states
        name = func.attr
        target = func.value
        chain = _attr_chain(target)
        callee_ctx: _Ctx | None = None
        after: str | None = None
        if chain == ["self"]:
            callee_ctx = ctx
        elif (
            isinstance(target, ast.Call)
            and isinstance(target.func, ast.Name)
            and target.func.id == "super"
        ):
            callee_ctx, after = ctx, owner
        elif chain == ["self", "pool"] and ctx.cls != ctx.pool:
            callee_ctx = _Ctx(ctx.pool, ctx.pool, ctx.same_layer)
        elif (
            chain is not None
            and len(chain) == 2
            and chain[0] == "self"
            and chain[1] in HELPER_ATTRS
        ):
            helper = self.helper_class(ctx.pool)
            callee_ctx = _Ctx(helper, ctx.pool, ctx.same_layer)
        if callee_ctx is not None:
            found = _resolve(self.classes, callee_ctx.cls, name, after)
            if found is None:
                if name.startswith(("get_", "_get_")) or "buffer" in name:
                    return self._read(states, owner, call, f"unresolved {name}()")
                return states
            c_owner, c_fn = found
            passes = self._passes_layer(call, c_fn, fn)
            if passes is False:
                return states  # works on another layer: neither orders nor reads this one
            sub = _Ctx(callee_ctx.cls, callee_ctx.pool, ctx.same_layer)
            outs = self.method(sub, c_owner, c_fn, top=False)
            result: set[State] = set()
            for s in states:
                if s != CLEAN:
                    result.add(s)
                else:
                    result |= outs
            return result
        if name == "wait_event" and self._slot_ready_is_ordered(call, ctx):
            return {WAITED if s == CLEAN else s for s in states}
        if name in READ_OPS:
            return self._read(states, owner, call, f".{name}()")
        if (
            chain is not None
            and chain[0] == "self"
            and (name.startswith(("get_", "_get_")) or "buffer" in name)
        ):
            # another object's getter (an inner pool, whose counter a wrapper sets to None)
            return self._read(states, owner, call, f"{'.'.join(chain)}.{name}()")
        if isinstance(target, ast.Call) and name.startswith(("get_", "_get_")):
            return self._read(states, owner, call, f"<call>.{name}()")
        return states

    def _slot_ready_is_ordered(self, call: ast.Call, ctx: _Ctx) -> bool:
        """``current_stream().wait_event(slot.ready)`` of the page-interleave read path.

        ``slot.ready`` is recorded on the gather stream by ``_prefetch_layer(layer)`` after that
        gather waited for the layer's load (page_interleave_pool.py:507-541); waiting on it
        orders the read after the load iff ``_prefetch_layer`` itself is ordered.
        """
        if not call.args or not ctx.same_layer:
            return False
        chain = _attr_chain(call.args[0])
        if not chain or chain[-1] != "ready":
            return False
        found = _resolve(self.classes, ctx.pool, "_prefetch_layer")
        if found is None:
            return False
        outs = self.method(_Ctx(ctx.pool, ctx.pool, True), found[0], found[1], top=False)
        return not any(s[0] == "read" for s in outs)  # every gather path waited first

    # ---- entry -----------------------------------------------------------------------------

    def getter(self, pool: str, name: str) -> tuple[bool, str]:
        found = _resolve(self.classes, pool, name)
        if found is None:
            return False, "not found"
        owner, fn = found
        outs = self.method(_Ctx(pool, pool, True), owner, fn, top=True)
        reads = sorted(s[1] for s in outs if s[0] == "read")
        if reads:
            return False, f"reads before the layer wait: {reads[0]}"
        return True, f"defined in {owner} ({self.classes[owner].path}:{fn.lineno})"


def pool_classes(classes: dict[str, _ClassInfo]) -> tuple[list[str], list[str]]:
    """(pool classes to check, classes with index getters this rule cannot place)."""
    dsa = [c for c in classes if DSA_BASE in _mro(classes, c)]
    others, unplaced = [], []
    for c in classes:
        if c in dsa or c in INNER_POOLS:
            continue
        if not _index_getters(classes, c):
            continue
        if KV_BASE in _mro(classes, c):
            others.append(c)
        elif not c.endswith("IndexKeyCache"):  # key caches are analysed inside their pool
            unplaced.append(c)
    return sorted(dsa) + sorted(others), sorted(unplaced)


def _index_getters(classes: dict[str, _ClassInfo], cls: str) -> list[str]:
    names = {m for c in _mro(classes, cls) for m in classes[c].methods}
    return sorted(m for m in names if INDEX_GETTER.match(m) and m not in NOT_GETTERS)


def required_getters(classes: dict[str, _ClassInfo]) -> list[tuple[str, str]]:
    pools, _ = pool_classes(classes)
    out: list[tuple[str, str]] = []
    for pool in pools:
        names = _index_getters(classes, pool)
        if DSA_BASE in _mro(classes, pool):
            names += [m for m in KV_GETTERS if _resolve(classes, pool, m)]
        names += [m for m in PREFETCHERS if _resolve(classes, pool, m)]
        out += [(pool, m) for m in names]
    return out


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def check_sources(
    sources: Mapping[str, str],
    version: str | None = None,
    *,
    patched: Mapping[str, str] | None = None,
) -> HiCacheVerdict:
    """Check SGLang source text: ``{relative path under the package: text}``."""
    patched = PATCHED if patched is None else patched
    classes = parse_classes(sources)
    need = f"sglang >= {MIN_SGLANG_VERSION} (the engine image pins a version that has it)"
    pools, unplaced = pool_classes(classes)
    if DSA_BASE not in classes:
        return HiCacheVerdict(
            False,
            version,
            {},
            f"no DSA/NSA token-to-KV pool found ({DSA_BASE}); cannot verify HiCache load "
            f"ordering; need {need}",
        )
    analyzer = _Analyzer(classes)
    getters: dict[str, bool] = {}
    problems: dict[str, str] = {}
    used_patches: dict[str, str] = {}
    for pool, name in required_getters(classes):
        key = f"{pool}.{name}"
        ok, why = analyzer.getter(pool, name)
        if not ok and key in patched:
            used_patches[key] = patched[key]
            problems[key] = f"{why}; closed by {patched[key]}"
            ok = True
        elif not ok:
            problems[key] = why
        getters[key] = ok
    for cls in unplaced:
        getters[f"{cls}.*"] = False
        problems[f"{cls}.*"] = "index-cache getters on a class the check cannot place"
    missing = sorted(k for k, ok in getters.items() if not ok)
    if not getters or missing:
        detail = "; ".join(f"{k}: {problems[k]}" for k in missing) or "(no getters found)"
        return HiCacheVerdict(
            False,
            version,
            getters,
            f"HiCache load-use ordering NOT guaranteed: {detail}; disable HiCache or use {need}",
            problems,
            used_patches,
            tuple(pools),
        )
    if version is not None and _version_tuple(version) < _version_tuple(MIN_SGLANG_VERSION):
        return HiCacheVerdict(
            False,
            version,
            getters,
            f"sglang {version} is older than {MIN_SGLANG_VERSION}; need {need}",
            problems,
            used_patches,
            tuple(pools),
        )
    return HiCacheVerdict(
        True,
        version,
        getters,
        f"HiCache load-use ordering ok: {len(getters)} getter(s) of {len(pools)} pool "
        f"class(es) wait for the layer load before reading"
        + (f", {len(used_patches)} via cas patches" if used_patches else "")
        + f" (sglang {version or 'unknown'})",
        problems,
        used_patches,
        tuple(pools),
    )


def read_sources(root: Path, files: Iterable[str] = SOURCE_FILES) -> dict[str, str]:
    return {
        rel: (root / rel).read_text(encoding="utf-8") for rel in files if (root / rel).is_file()
    }


def check_source_tree(root: Path, version: str | None = None) -> HiCacheVerdict:
    """Check the SGLang package directory ``root`` (the folder holding ``srt/``)."""
    return check_sources(read_sources(root), version)


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
