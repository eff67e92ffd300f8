"""Measured test durations for the suite's scheduler, and the per-module table of the docs.

    python tools/test_durations.py run/junit.xml            # rewrite tests/durations.json
    python tools/test_durations.py run/junit.xml --table    # print the per-module table
    python tools/test_durations.py run/junit.xml --waits run/waits.jsonl  # where tests wait

Reads a pytest JUnit report (``make test`` writes ``run/junit.xml``; each case's time is its
setup, call and teardown) and writes the tests that took a second or more, by node id, for the
root ``conftest.py`` to hand out the longest first. The table is docs/development.md's.
``--waits`` reads the waits ``e2e.waits`` recorded (``make test`` sets ``$CAS_E2E_WAIT_LOG``)
and prints, for each test over a threshold, its time and the waits that made it up.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "durations.json"
MIN_SECONDS = 1.0


def node_id(classname: str, name: str) -> str:
    """``e2e.tests.test_x`` + ``test_y[a]`` -> ``e2e/tests/test_x.py::test_y[a]`` (a class
    inside the module stays a ``::`` part; the ``@group`` suffix xdist's loadgroup adds is
    dropped)."""
    name = without_group(name)
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).exists():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def without_group(nodeid: str) -> str:
    """``test_y[a]@g`` -> ``test_y[a]``: the id a test has without xdist's group suffix."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def read(report: Path) -> dict[str, float]:
    cases = ET.parse(report).getroot().iter("testcase")
    return {
        node_id(c.get("classname", ""), c.get("name", "")): float(c.get("time", 0)) for c in cases
    }


def table(durations: dict[str, float]) -> str:
    by_module: dict[str, list[float]] = defaultdict(list)
    for nodeid, seconds in durations.items():
        by_module[nodeid.split("::")[0]].append(seconds)
    rows = sorted(by_module.items(), key=lambda kv: -sum(kv[1]))
    lines = ["| module | tests | seconds | longest |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| `{m}` | {len(s)} | {sum(s):.0f} | {max(s):.0f} |" for m, s in rows]
    return "\n".join(lines)


def waits_table(durations: dict[str, float], log: Path, min_seconds: float = 20.0) -> str:
    """Tests of `min_seconds` or more, longest first: total, then each recorded wait of a
    second or more (phase: what = seconds, summed over repeats)."""
    waits: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in log.read_text().splitlines():
        w = json.loads(line)
        waits[without_group(w["test"])][f"{w['phase']}: {w['what']}"] += w["seconds"]
    lines = ["| test | seconds | waits (s) |", "| --- | ---: | --- |"]
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1]):
        if seconds < min_seconds:
            break
        parts = [f"{k} {v:.0f}" for k, v in sorted(waits[nodeid].items(), key=lambda kv: -kv[1])
                 if v >= 1.0]  # fmt: skip
        lines.append(f"| `{nodeid.split('::', 1)[1]}` | {seconds:.0f} | {'; '.join(parts)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--table", action="store_true", help="print the per-module table")
    parser.add_argument("--waits", type=Path, help="print where the long tests waited")
    args = parser.parse_args(argv)
    durations = read(args.report)
    if args.waits:
        print(waits_table(durations, args.waits))
        return 0
    if args.table:
        print(table(durations))
        return 0
    kept = {k: round(v, 1) for k, v in sorted(durations.items()) if v >= MIN_SECONDS}
    OUT.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{len(kept)} of {len(durations)} tests took {MIN_SECONDS:.0f} s or more -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
