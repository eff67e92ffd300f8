"""Compile real SGLang functions and classes from the installed source, without importing
their modules (they import torch at top level, which the CPU venv does not have): the tests
then run the real code against stubs placed in the namespace they compile into."""

from __future__ import annotations
import __future__

import ast
import functools
from pathlib import Path
from typing import Any


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """Parse each real source once per session (compiling from the tree does not mutate it)."""
    return ast.parse(path.read_text(), filename=str(path))


def compile_from(
    path: Path,
    ns: dict[str, Any],
    *,
    cls: str | None = None,
    names: tuple[str, ...] = (),
    as_name: str | None = None,
    whole: bool = False,
) -> Any:
    """Compile real code from ``path`` into ``ns``: module functions ``names``, the methods
    ``names`` of class ``cls`` as a new class ``as_name``, or (``whole``) class ``cls`` as is."""
    tree = _parsed(path)
    if whole:
        body: list[ast.stmt] = [
            n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls
        ]
        assert body, f"{cls} missing in {path}"
    else:
        scope = tree.body
        if cls is not None:
            scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        funcs = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name in names]
        assert {f.name for f in funcs} == set(names), f"missing in {path.name}: {names}"
        body = list(funcs)
        if cls is not None:
            body = [
                ast.ClassDef(
                    name=as_name or cls,
                    bases=[],
                    keywords=[],
                    body=funcs,
                    decorator_list=[],
                    type_params=[],
                    lineno=1,
                    col_offset=0,
                )
            ]
    code = compile(
        ast.Module(body=body, type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, ns)
    return ns[as_name or cls] if cls else ns
