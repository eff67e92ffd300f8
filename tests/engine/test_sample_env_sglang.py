"""Every environment variable a sample (or the annotated spec in docs/resource.md) sets in
`engine.env` is one the engine reads: SGLang 0.5.23, per its installed source, or cas_engine.

Regression (issue 41, item 13): the GLM-5 sample and docs/resource.md set
`SGLANG_ENABLE_SPEC_V2=1`, which SGLang 0.5.23 never reads (no such field in
srt/environ.py's `Envs`, no `os.environ`/`getenv` use anywhere): users copied a setting that
does nothing. The set of names SGLang reads is taken from the installed package's source
(`tests/env_reads.py`: `Envs` fields and their old names, `os.getenv`/`os.environ` reads,
SGLang's `get_*_env_var` helpers), never from a hand list; SGLang rewrites a legacy `SGL_`
name to `SGLANG_` (srt/environ.py `_handle_deprecated_envs`) and names it only deprecates
(`_DEPRECATED_ENVS`) do nothing, so they do not count. Marked `sglang_real`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

import pytest
import yaml

from cas_engine.sglang.version import PINNED_SGLANG_VERSION
from tests.env_reads import EnvReads, cache_dir, package_dir, reads_under
from tests.paths import ROOT, SAMPLES

SGLANG = package_dir("sglang")
ENGINE = package_dir("cas_engine")
pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.skipif(SGLANG is None, reason="sglang not installed (make setup installs it)"),
]


@functools.cache
def sglang_reads() -> EnvReads:
    """What the SGLang server reads: its runtime (`srt/`) and the top-level modules
    (`sglang.launch_server`), not its benchmarks, tests or diffusion runtime."""
    assert SGLANG is not None
    assert importlib.metadata.version("sglang") == PINNED_SGLANG_VERSION
    return reads_under([*SGLANG.glob("*.py"), *(SGLANG / "srt").rglob("*.py")], cache_dir())


def engine_layer_reads() -> EnvReads:
    """cas_engine's own variables (the launcher, the plugin, the guard); not the CPU
    stand-in's (`sim/`), which never runs in an engine pod."""
    assert ENGINE is not None
    return reads_under(p for p in ENGINE.rglob("*.py") if "sim" not in p.relative_to(ENGINE).parts)


def sglang_deprecated() -> set[str]:
    """The keys of `_DEPRECATED_ENVS` in srt/environ.py: read only to warn."""
    assert SGLANG is not None
    source = (SGLANG / "srt" / "environ.py").read_text()
    block = source.split("_DEPRECATED_ENVS: Dict[str, _DeprecatedEnv] = {", 1)[1].split("\n}", 1)
    return set(re.findall(r'^    "([A-Z0-9_]+)": _DeprecatedEnv', block[0], re.M))


def known(name: str) -> bool:
    reads = sglang_reads()
    if name.startswith("SGL_"):  # srt/environ.py: SGL_X is read as SGLANG_X
        name = "SGLANG_" + name.removeprefix("SGL_")
    if name in sglang_deprecated():
        return False
    return reads.reads(name) or engine_layer_reads().reads(name)


def documented_spec() -> dict[str, Any]:
    """The annotated spec at the top of docs/resource.md."""
    text = (ROOT / "docs" / "resource.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert block is not None
    spec: dict[str, Any] = yaml.safe_load(block.group(1))["spec"]
    return spec


def specs() -> list[tuple[str, dict[str, Any]]]:
    samples = sorted(SAMPLES.glob("*.yaml"))
    found = [(p.name, yaml.safe_load(p.read_text())["spec"]) for p in samples]
    return [*found, ("docs/resource.md", documented_spec())]


@pytest.mark.parametrize(("where", "spec"), specs(), ids=[w for w, _ in specs()])
def test_every_sample_env_var_is_one_the_engine_reads(where: str, spec: dict[str, Any]) -> None:
    names = [var["name"] for var in (spec.get("engine") or {}).get("env") or []]
    unread = [name for name in names if not known(name)]
    assert unread == [], f"{where} sets {unread}, which SGLang {PINNED_SGLANG_VERSION} never reads"


def test_the_scan_sees_what_sglang_reads() -> None:
    """The harness: names SGLang reads through each path are found (an `Envs` field, an old
    name of an aliased field, `os.environ.get`, `os.getenv`), the removed one is not."""
    reads = sglang_reads()
    for name in (
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",  # Envs field (environ.py:763)
        "SGLANG_USE_PICKLE_IPC",  # Envs field, read by cas_engine's launcher too
        "CUDA_VISIBLE_DEVICES",  # os.environ reads
    ):
        assert reads.reads(name), name
    assert not known("SGLANG_ENABLE_SPEC_V2")
    assert not known("SGLANG_ENABLE_CP_V2")  # deprecated: "removed without replacement"
    assert known("SGL_DISAGGREGATION_WAITING_TIMEOUT")  # the legacy prefix
    assert known("CAS_HICACHE_CHECK") and known("CAS_GUARD_ENABLED")  # cas_engine's own
