"""Which environment variables a body of Python source reads, from its syntax tree (import as
`tests.env_reads`). Nothing is imported or run, so this works on SGLang's source without torch.

A read is:

- a string (or a module-level string constant) passed to a call whose callee's dotted name
  mentions `env` or `environ` (`os.getenv`, `os.environ.get`, `environ.setdefault`,
  `env.get`, SGLang's `get_bool_env_var`, ...), or to such a call as `PREFIX + name` (then
  `PREFIX` is a prefix every name under it is read by);
- a subscript of something whose dotted name ends in `environ` (`os.environ["X"]`), and
  `"X" in os.environ`;
- a module-level string constant whose name ends in `_ENV` (cas_engine's convention for the
  name of a variable it reads or sets);
- an attribute of SGLang's registry object `envs` (`envs.SGLANG_USE_PICKLE_IPC.get()`), and a
  field of its `Envs` class (sglang/srt/environ.py: `SGLANG_X = EnvBool(...)`, each read by
  name through `os.getenv(self.name)`), with the old name of an `...WithAlias` field.

This over-approximates on purpose (a call that writes a variable counts too): the tests using
it check that names are *in* the set, so a missed read would fail them, a spare one would not.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class EnvReads:
    names: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)

    def reads(self, name: str) -> bool:
        return name in self.names or any(name.startswith(p) for p in self.prefixes)

    def __ior__(self, other: EnvReads) -> EnvReads:
        self.names |= other.names
        self.prefixes |= other.prefixes
        return self


def dotted(node: ast.AST) -> str:
    """`os.environ.get` for that call's callee; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` (and annotated) assignments."""
    found: dict[str, str] = {}
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            found.update({target.id: value.value} if isinstance(value.value, str) else {})
    return found


def _text(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _is_env_callee(name: str) -> bool:
    """`os.getenv`, `os.environ.get`, `get_bool_env_var`...; not SGLang's `EnvBool("x")`
    field constructors, whose argument is a default value."""
    parts = name.rsplit(".", 2)
    return not parts[-1].startswith("Env") and any("env" in part.lower() for part in parts)


def _from_call(node: ast.Call, constants: dict[str, str], out: EnvReads) -> None:
    if not node.args or not _is_env_callee(dotted(node.func)):
        return
    arg = node.args[0]
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add):
        prefix = _text(arg.left, constants)
        if prefix and ENV_NAME.match(prefix):
            out.prefixes.add(prefix)
        return
    text = _text(arg, constants)
    if text and ENV_NAME.match(text):
        out.names.add(text)


def _envs_class(node: ast.ClassDef, out: EnvReads) -> None:
    """SGLang's `class Envs` registry: every field is a variable read by its own name."""
    for item in node.body:
        if not (isinstance(item, ast.Assign) and isinstance(item.value, ast.Call)):
            continue
        if not dotted(item.value.func).startswith("Env"):
            continue
        out.names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for keyword in item.value.keywords:
            if keyword.arg == "deprecated_name" and isinstance(keyword.value, ast.Constant):
                out.names.add(str(keyword.value.value))


def reads_in(path: Path) -> EnvReads:
    """Every variable one source file reads (see the module docstring)."""
    with warnings.catch_warnings():  # invalid escapes in others' docstrings
        warnings.simplefilter("ignore")
        tree = ast.parse(path.read_text(), filename=str(path))
    constants = _constants(tree)
    out = EnvReads()
    out.names.update(v for k, v in constants.items() if k.endswith("_ENV") and ENV_NAME.match(v))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            _from_call(node, constants, out)
        elif isinstance(node, ast.ClassDef) and node.name == "Envs":
            _envs_class(node, out)
        elif (name := _named_read(node, constants)) is not None:
            out.names.add(name)
    return out


def _named_read(node: ast.AST, constants: dict[str, str]) -> str | None:
    """`os.environ["X"]`, `"X" in os.environ`, `envs.X`: the name X, else None."""
    key: ast.AST | None = None
    if isinstance(node, ast.Subscript) and dotted(node.value).endswith("environ"):
        key = node.slice
    elif isinstance(node, ast.Compare) and any(
        isinstance(op, ast.In | ast.NotIn) and dotted(right).endswith("environ")
        for op, right in zip(node.ops, node.comparators, strict=True)
    ):
        key = node.left
    elif isinstance(node, ast.Attribute) and dotted(node.value) == "envs":
        return node.attr
    text = _text(key, constants) if key is not None else None
    return text if text and ENV_NAME.match(text) else None


def reads_under(files: Iterable[Path], cache_dir: Path | None = None) -> EnvReads:
    """Every variable the files read. With `cache_dir`, the answer is kept there under a hash
    of this scanner's source and of every file's path and bytes (SGLang's 2,000 files take
    ~12 s of CPU to parse; hashing them ~0.2 s): any change to either scans again."""
    paths = sorted(files)
    cached = cache_dir / f"{_digest(paths)}.json" if cache_dir is not None else None
    if cached is not None and cached.exists():
        data = json.loads(cached.read_text())
        return EnvReads(set(data["names"]), set(data["prefixes"]))
    out = EnvReads()
    for path in paths:
        out |= reads_in(path)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"names": sorted(out.names), "prefixes": sorted(out.prefixes)}))
        tmp.replace(cached)
    return out


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for path in paths:
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where scans of installed packages are kept between runs, beside the project's other
    caches (the virtualenvs, the binaries)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cas-operator" / "env-reads"


def package_dir(name: str) -> Path | None:
    """Where an installed package's source lives, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
