"""Trace requests as prompt text (bench.replay.prompts) and the session placements of the
replay (issue 40).

Guards: a block whose tokens change with what stands before it (the sim's chat template's
role tag is 9 bytes: unpadded, every block would straddle tokens and two prompts would share
fewer tokens than the trace says), token scaling that breaks the prefix structure, a fresh
tail shared by two requests, and placements that change between runs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from bench.replay.prompts import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    Scale,
    block_text,
    lead_pad,
    prompt_for,
    scaled_blocks,
)
from bench.replay.sources import open_source, placements
from bench.traces import TraceRequest, read_sessions
from cas_engine.sim.prefix_cache import PrefixCache
from cas_engine.sim.server import chat_prompt
from cas_engine.sim.textgen import tokenize
from tests.real_traces import CLAUDE_SESSIONS, require


def _request(ids: list[int], n_in: int, block_size: int = 64, out: int = 100) -> TraceRequest:
    arr = np.asarray(ids, dtype=np.int64)
    return TraceRequest(t=0.0, input_tokens=n_in, output_tokens=out, block_ids=arr,
                        block_size=block_size)  # fmt: skip


def _hit(*prompts: np.ndarray) -> list[int]:
    cache = PrefixCache(BLOCK_TOKENS, 10_000_000)
    return [cache.match_and_insert(p) for p in prompts]


def test_two_prompts_share_exactly_the_blocks_the_trace_says() -> None:
    """Regression: the sim counts a shared prefix of m trace blocks as exactly m x 64 cached
    tokens, whatever m, and the prompt has the trace's token count (plus the template's)."""
    base = list(range(100, 140))
    for m in (0, 1, 7, 39):
        a = prompt_for(_request(base, 40 * 64 + 30), "s@0", "a", Scale())
        b = prompt_for(_request(base[:m] + [900 + i for i in range(40 - m)], 40 * 64 + 5),
                       "s@0", "b", Scale())  # fmt: skip
        assert _hit(a.tokens(), b.tokens()) == [0, m * BLOCK_TOKENS]
        template = len(tokenize(chat_prompt([{"role": "user", "content": lead_pad()}])))
        assert len(a.tokens()) == template + 40 * 64 + 30
    assert block_text("s@0", (1, 63)) != block_text("s@1", (1, 63))  # scopes are separate
    assert len(block_text("s@0", (1, 63)).encode()) == BLOCK_CHARS


def test_blocks_start_on_a_token_boundary_after_the_role_tag() -> None:
    """Regression: each block is the same 64 tokens wherever it stands."""
    prompt = prompt_for(_request([7, 8], 128), "s@0", "x", Scale())
    text = chat_prompt(prompt.messages())
    at = text.index(block_text("s@0", (7, 63)))
    assert at % 4 == 0 and lead_pad() == " " * ((4 - len("<|user|>\n")) % 4)
    tokens = tokenize(text)
    assert tokens[at // 4 : at // 4 + BLOCK_TOKENS].tobytes() == block_text("s@0", (7, 63)).encode()


def test_token_scale_keeps_the_prefix_structure() -> None:
    """Regression: at 1/f, a run of f trace blocks is one sent block keyed by its last id, so
    prompts share floor(k/f) sent blocks where the trace shares k blocks."""
    ids = list(range(1, 33))
    every_fourth = tuple((i, 63) for i in range(4, 33, 4))
    assert scaled_blocks(_request(ids, 32 * 64), 4) == every_fourth
    for shared in (3, 4, 13, 32):
        other = ids[:shared] + [500 + i for i in range(32 - shared)]
        a = prompt_for(_request(ids, 32 * 64 + 10), "s@0", "a", Scale(tokens=4))
        b = prompt_for(_request(other, 32 * 64 + 10), "s@0", "b", Scale(tokens=4))
        assert _hit(a.tokens(), b.tokens())[1] == (shared // 4) * BLOCK_TOKENS
        assert a.tail_tokens == round((32 * 64 + 10) / 4) - 8 * BLOCK_TOKENS
        assert a.output_tokens == 25


def test_mooncake_blocks_of_512_tokens_become_eight_blocks() -> None:
    keys = scaled_blocks(_request([5, 6], 1100, block_size=512), 1)
    assert keys == tuple((5, 64 * j + 63) for j in range(8)) + tuple(
        (6, 64 * j + 63) for j in range(8)
    )


def test_a_fresh_tail_is_the_requests_own() -> None:
    a = prompt_for(_request([1], 64 + 40), "s@0", "s@0/t#1", Scale())
    b = prompt_for(_request([1], 64 + 40), "s@0", "s@0/t#2", Scale())
    assert a.tail_tokens == 40 and a.content != b.content
    assert _hit(a.tokens(), b.tokens())[1] == BLOCK_TOKENS  # the block, not the tail


def test_placements_are_seeded_and_bounded() -> None:
    keys = [f"k{i}" for i in range(5)]
    first = placements(keys, 0.5, 12, seed=3)
    assert first == placements(keys, 0.5, 12, seed=3)
    assert len(first) == 12 and len({p.scope for p in first}) == 12
    assert sorted(p.key for p in first[:5]) == keys  # each session once before any repeats
    assert all(a.start_s <= b.start_s for a, b in itertools.pairwise(first))
    assert {p.start_s for p in placements(keys, 0.0, 3, seed=1)} == {0.0}


def test_real_sessions_keep_their_reuse_as_prompts() -> None:
    """On real Claude Code sessions, at the replay's default token scale (16): the sim's
    prefix cache hits what the scaled trace blocks say, turn after turn."""
    path = require(CLAUDE_SESSIONS)
    session = next(read_sessions(path))
    scale = Scale(tokens=16)
    cache = PrefixCache(BLOCK_TOKENS, 10_000_000)
    seen: set[tuple[int, int]] = set()
    for turn, request in enumerate(session.requests[:20]):
        prompt = prompt_for(request, "real@0", f"real@0#{turn}", scale)
        expected = 0
        for key in prompt.block_keys:  # the longest prefix of blocks sent before
            if key not in seen:
                break
            expected += BLOCK_TOKENS
        assert cache.match_and_insert(prompt.tokens()) == expected, turn
        seen.update(prompt.block_keys)
    assert cache.hit_tokens > 0.5 * cache.total_tokens


def test_scale_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        Scale(tokens=0)
    with pytest.raises(ValueError):
        Scale(think=-1.0)


def test_mooncake_requests_share_one_scope_at_their_own_arrivals(tmp_path: Path) -> None:
    """Regression: Mooncake's block ids are one space for the whole trace, so its requests
    keep it in the replay (a scope per request would lose every cross-request hit); they
    start at the trace's arrivals, rescaled to the asked rate."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 7, 9]},
        {"timestamp": 6000, "input_length": 600, "output_length": 5, "hash_ids": [4, 5]},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = open_source(path, rate=1.0, count=2, seed=1)
    assert source.format == "mooncake" and [p.scope for p in source.places] == ["mooncake"] * 2
    assert [p.start_s for p in source.places] == pytest.approx([0.0, 1.0])
    a, b = (source.session(p.key).requests[0] for p in source.places)
    pa = prompt_for(a, "mooncake", "a", Scale(tokens=1))
    pb = prompt_for(b, "mooncake", "b", Scale(tokens=1))
    assert _hit(pa.tokens(), pb.tokens())[1] == 512  # block 1, as the ids say
