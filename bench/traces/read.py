"""Readers of the three trace formats in ../shared/traces (see its README), streaming.

Data flow: a path the caller names -> `read_sessions` picks the format by the path -> one
`TraceSession` at a time:

- Claude Code sessions: a folder of `*.json` session files, one such file, or a `.tar.gz` of
  them read member by member (never unpacked to disk); each file is one top-level session, its
  `subagent` requests become sessions of their own nested in it (`TraceSession.subagents`),
  their block ids in the top-level session's id space;
- Mooncake JSONL: every line one single-request session starting at its `timestamp` (ms ->
  s), all in one block id space (`MOONCAKE_SCOPE`, 512-token blocks), so prefixes shared across
  requests are shared blocks (its last id, which covers a partial block, is dropped: block ids
  are full blocks in every format);
- Azure CSV: every row one single-request session at its `TIMESTAMP`, no block ids (the whole
  prompt is a fresh tail).

Memory is bounded by one session (one member's JSON at a time). `SessionPool` keeps every
session of a Claude Code source as compressed JSON for random access (about the tarball's
size) and parses one when asked. `mooncake_arrivals` / `azure_arrivals` give the traces'
arrival times alone, for `overlay.trace_starts`.
"""

from __future__ import annotations

import csv
import json
import tarfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.traces.records import NO_BLOCKS, BlockIds, TraceRequest, TraceSession

CLAUDE_BLOCK_SIZE = 64  # the Claude Code traces' default `block_size`
MOONCAKE_BLOCK_SIZE = 512  # Mooncake's hash_ids cover 512 tokens each
MOONCAKE_SCOPE = "mooncake"  # Mooncake's ids are one space for the whole trace
SUBAGENT = "subagent"


class TraceFormatError(ValueError):
    """A trace file does not have the fields its format needs; the message names the file."""


# ---------------------------------------------------------------- dispatch


def read_sessions(path: str | Path) -> Iterator[TraceSession]:
    """Every session of the trace at `path`, one at a time (format by the path, module doc)."""
    p = Path(path)
    if p.is_dir() or _is_tarball(p) or p.suffix == ".json":
        yield from read_claude_sessions(p)
    elif p.suffix == ".jsonl":
        yield from read_mooncake(p)
    elif p.suffix == ".csv":
        yield from read_azure(p)
    else:
        raise TraceFormatError(f"{p}: not a folder, .tar.gz, .json, .jsonl or .csv trace")


def _is_tarball(p: Path) -> bool:
    return p.name.endswith((".tar.gz", ".tgz", ".tar"))


# ---------------------------------------------------------------- Claude Code sessions


def claude_members(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(member name, JSON bytes) of every session file: a folder's `*.json` by name, a
    tarball's regular `.json` members in archive order (streamed), or one file."""
    p = Path(path)
    if p.is_dir():
        for f in sorted(p.glob("*.json")):
            yield f.name, f.read_bytes()
    elif _is_tarball(p):
        with tarfile.open(p, mode="r|*") as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith(".json"):
                    continue
                handle = tar.extractfile(member)
                if handle is not None:
                    yield Path(member.name).name, handle.read()
    elif p.is_file():
        yield p.name, p.read_bytes()
    else:
        raise TraceFormatError(f"{p}: no such trace folder or file")


def read_claude_sessions(path: str | Path) -> Iterator[TraceSession]:
    """Top-level Claude Code sessions at `path` (a folder, a tarball or one file), streamed."""
    for name, raw in claude_members(path):
        yield parse_claude_session(_json(raw, name), Path(name).stem)


def _json(raw: bytes, name: str) -> Mapping[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise TraceFormatError(f"{name}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceFormatError(f"{name}: no `requests` list (not a Claude Code session file)")
    return doc


def parse_claude_session(doc: Mapping[str, Any], fallback_key: str = "session") -> TraceSession:
    """One Claude Code session file's JSON as a session (subagents nested, module doc)."""
    key = str(doc.get("id") or fallback_key)
    block_size = int(doc.get("block_size") or CLAUDE_BLOCK_SIZE)
    return _session(doc["requests"], key, key, block_size, 0.0)


def _session(
    items: Sequence[Mapping[str, Any]], key: str, root: str, block_size: int, start_s: float
) -> TraceSession:
    requests: list[TraceRequest] = []
    subagents: list[TraceSession] = []
    for item in items:
        if item.get("type") == SUBAGENT:
            name = str(item.get("agent_id") or f"subagent{len(subagents)}")
            sub_key = f"{key}/{name}"
            if any(s.key == sub_key for s in subagents):
                sub_key = f"{sub_key}#{len(subagents)}"
            sub_items = item.get("requests") or []
            subagents.append(
                _session(sub_items, sub_key, root, block_size, float(item.get("t") or 0.0))
            )
        else:
            requests.append(_claude_request(item, block_size, key))
    requests.sort(key=lambda r: r.t)  # stable: the files are in time order already
    return TraceSession(key, root, tuple(requests), start_s, tuple(subagents), "claude-code")


def _claude_request(item: Mapping[str, Any], block_size: int, key: str) -> TraceRequest:
    try:
        ids = _ids(item.get("hash_ids") or ())
        api = item.get("api_time")
        return TraceRequest(
            t=float(item["t"]),
            input_tokens=int(item["in"]),
            output_tokens=int(item["out"]),
            block_ids=ids,
            block_size=block_size,
            think_s=float(item.get("think_time") or 0.0),
            api_s=None if api is None else float(api),
            kind=str(item.get("type") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"{key}: a request without t/in/out ({exc})") from exc


def _ids(values: Sequence[int]) -> BlockIds:
    if not values:
        return NO_BLOCKS
    ids = np.asarray(values, dtype=np.int64)
    ids.setflags(write=False)
    return ids


@dataclass
class SessionPool:
    """Every top-level session of a Claude Code source, kept as compressed JSON (about the
    tarball's size in memory) for random access: `session(key)` parses one on demand."""

    _compressed: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path, limit: int | None = None) -> SessionPool:
        """The sessions at `path` (at most `limit`, in the source's order)."""
        pool = cls()
        for name, raw in claude_members(path):
            if limit is not None and len(pool._compressed) >= limit:
                break
            key = str(_json(raw, name).get("id") or Path(name).stem)
            pool._compressed[key] = zlib.compress(raw, 1)
        return pool

    @property
    def keys(self) -> list[str]:
        return list(self._compressed)

    def __len__(self) -> int:
        return len(self._compressed)

    def session(self, key: str) -> TraceSession:
        raw = zlib.decompress(self._compressed[key])
        return parse_claude_session(_json(raw, key), key)

    def __iter__(self) -> Iterator[TraceSession]:
        return (self.session(k) for k in self._compressed)


# ---------------------------------------------------------------- Mooncake JSONL


def read_mooncake(path: str | Path) -> Iterator[TraceSession]:
    """Every Mooncake request as a single-request session at its arrival (module doc)."""
    with Path(path).open(encoding="utf-8") as lines:
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                n_in = int(row["input_length"])
                full = n_in // MOONCAKE_BLOCK_SIZE  # its last id covers a partial block: dropped
                request = TraceRequest(
                    t=0.0,
                    input_tokens=n_in,
                    output_tokens=int(row["output_length"]),
                    block_ids=_ids((row.get("hash_ids") or ())[:full]),
                    block_size=MOONCAKE_BLOCK_SIZE,
                )
                start = float(row["timestamp"]) / 1000.0
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{n + 1}: not a Mooncake request ({exc})") from exc
            yield TraceSession(
                f"{MOONCAKE_SCOPE}/{n}", MOONCAKE_SCOPE, (request,), start, (), "mooncake"
            )


def mooncake_arrivals(path: str | Path) -> np.ndarray:
    """The Mooncake trace's arrival times in seconds from its first, sorted."""
    times = np.array([s.start_s for s in read_mooncake(path)], dtype=float)
    return np.sort(times - times.min()) if len(times) else times


# ---------------------------------------------------------------- Azure CSV


def _azure_time(text: str) -> float:
    """Seconds since the epoch of `2023-11-16 18:17:03.9799600` (7 fraction digits)."""
    whole, _, fraction = text.strip().partition(".")
    base = datetime.fromisoformat(whole).timestamp()
    return base + (float(f"0.{fraction}") if fraction else 0.0)


def read_azure(path: str | Path) -> Iterator[TraceSession]:
    """Every Azure row as a single-request session without block ids (module doc)."""
    with Path(path).open(encoding="utf-8", newline="") as handle:
        first: float | None = None
        for n, row in enumerate(csv.DictReader(handle)):
            try:
                at = _azure_time(row["TIMESTAMP"])
                request = TraceRequest(
                    t=0.0,
                    input_tokens=int(row["ContextTokens"]),
                    output_tokens=int(row["GeneratedTokens"]),
                    block_ids=NO_BLOCKS,
                    block_size=CLAUDE_BLOCK_SIZE,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{n + 2}: not an Azure row ({exc})") from exc
            first = at if first is None else first
            key = f"azure/{n}"
            yield TraceSession(key, key, (request,), at - first, (), "azure")


def azure_arrivals(path: str | Path) -> np.ndarray:
    """The Azure trace's arrival times in seconds from its first, sorted."""
    times = np.array([s.start_s for s in read_azure(path)], dtype=float)
    return np.sort(times - times.min()) if len(times) else times
