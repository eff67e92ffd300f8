"""The Argo CD health check (charts/cas-operator/argocd/.../health.lua) under Lua 5.1.

Argo CD runs resource health scripts in gopher-lua (Lua 5.1) with only the safe libraries;
here `lupa.lua51` runs the same file with the same globals only (no os, io, require, load),
over Argo CD's own test layout (health_test.yaml, testdata/). Regression guarded: the script
shipped untested, concatenated a possibly missing `reason` (a Lua error shows every fleet as
Unknown in Argo CD), called a fleet Healthy while an older revision was still rolling out, and
reported the old `Degraded` of a spec the user had just fixed (the Degraded check ran before
the generation check: case fixed-spec-not-observed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51 as lua51
import pytest
import yaml

from tests.paths import ROOT

CHECK = ROOT / "charts/cas-operator/argocd/serving.cas.dev/CodingAgentServing"
SAFE_GLOBALS = ("ipairs", "pairs", "next", "type", "tostring", "tonumber", "select", "error",
                "pcall", "string", "table", "math")  # fmt: skip
CASES = yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]


def to_lua(lua: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, str]:
    """Run health.lua as Argo CD does: `obj` global, the script's return value the result."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=False)
    env = lua.table_from({name: lua.globals()[name] for name in SAFE_GLOBALS})
    env["obj"] = to_lua(lua, obj)
    chunk = lua.eval(
        "function(code, env) return assert(setfenv(assert(loadstring(code)), env)) end"
    )
    result = chunk((CHECK / "health.lua").read_text(), env)()
    return {"status": result["status"], "message": result["message"]}


@pytest.mark.parametrize("case", CASES, ids=[Path(c["inputPath"]).stem for c in CASES])
def test_health_matches_argocd_test_cases(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((CHECK / case["inputPath"]).read_text())
    assert health(obj) == case["healthStatus"]


def test_every_testdata_file_is_a_case() -> None:
    files = {f"testdata/{p.name}" for p in (CHECK / "testdata").glob("*.yaml")}
    assert files == {c["inputPath"] for c in CASES}


def test_the_sandbox_has_no_os_or_io() -> None:
    """The harness itself: a script reaching for os or io must fail here as in Argo CD."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=False)
    env = lua.table_from({name: lua.globals()[name] for name in SAFE_GLOBALS})
    run = lua.eval("function(code, env) return pcall(setfenv(loadstring(code), env)) end")
    ok, _ = run("return os.time()", env)
    assert ok is False
