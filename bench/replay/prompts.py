"""Real trace requests as prompt text with the same prefix structure (pure).

Each (block id scope, block) of a trace becomes one deterministic block of ``BLOCK_TOKENS``
tokens of text, so two prompts share text (and, in the engines and the router, tokens and
cache blocks) exactly as far as the trace says their token prefixes are equal.

The block's text is sized for the sim engine's tokenizer (``cas_engine.sim.textgen.tokenize``:
4 UTF-8 bytes a token): 256 ASCII characters, the hex digits of a SHAKE-256 digest of the
block's key. The sim's chat template puts a role tag before the message
(``cas_engine.sim.server.chat_prompt``); the message starts with a pad that brings the first
block to a 4-byte boundary, so every block is exactly the same 64 tokens wherever it stands
and no token spans two blocks. On a real model's tokenizer the prefix structure is the same,
the token counts are not.

Scaling (``Scale.tokens`` = f): token counts are divided by f. A prompt's trace tokens are cut
into runs of ``BLOCK_TOKENS * f`` trace tokens; each run fully inside the trace's block ids
becomes one block keyed by the id of the trace block holding the run's last token and that
token's offset in it (the ids are prefix-chained: equal ids, equal prefixes); the rest of the
prompt, ``input / f`` tokens in all, is a fresh tail unique to the request. So a Claude Code
request (64-token blocks) at f = 16 sends one block per 16 of its blocks; a Mooncake request
(512-token blocks) at f = 1 sends 8 blocks per block. Output tokens are divided by f too
(at least 1). The bound (``bench.replay.bound``) reads the very prompts sent, so both sides
see the same scaled stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from bench.traces import TraceRequest
from cas_engine.sim.server import chat_prompt
from cas_engine.sim.textgen import tokenize

BLOCK_TOKENS = 64  # the sim's --sim-block-size default, and the Claude Code traces' block
BYTES_PER_TOKEN = 4  # cas_engine.sim.textgen.tokenize
BLOCK_CHARS = BLOCK_TOKENS * BYTES_PER_TOKEN
_MARK = "\x00"


@dataclass(frozen=True)
class Scale:
    """The stated factors of a replay: token counts divided by `tokens`, think times
    multiplied by `think`."""

    tokens: int = 1
    think: float = 1.0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.think < 0:
            raise ValueError("token scale must be >= 1 and think scale >= 0")


@dataclass(frozen=True)
class Prompt:
    """One request's message and what the sim engine will count of it."""

    content: str
    block_keys: tuple[tuple[int, int], ...]  # (trace block id, offset of the run's last token)
    tail_tokens: int
    output_tokens: int

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.content}]

    def tokens(self) -> np.ndarray:
        """The prompt's token ids as the sim engine tokenizes the chat request."""
        return tokenize(chat_prompt(self.messages()))


@cache
def lead_pad() -> str:
    """Spaces that bring the message's first character to a token boundary after the sim's
    chat template's role tag."""
    template = chat_prompt([{"role": "user", "content": _MARK}])
    offset = len(template[: template.index(_MARK)].encode("utf-8"))
    return " " * ((-offset) % BYTES_PER_TOKEN)


def block_text(scope: str, block: tuple[int, int]) -> str:
    """The 64 tokens of text of one block of block id space `scope` (deterministic)."""
    key = f"{scope}\x1f{block[0]}\x1f{block[1]}".encode()
    return hashlib.shake_256(key).hexdigest(BLOCK_CHARS // 2)


def fresh_text(label: str, tokens: int) -> str:
    """`tokens` tokens of text no other request has (deterministic per `label`)."""
    if tokens <= 0:
        return ""
    return hashlib.shake_256(f"fresh\x1f{label}".encode()).hexdigest(tokens * BYTES_PER_TOKEN)[
        : tokens * BYTES_PER_TOKEN
    ]


def scaled_blocks(request: TraceRequest, factor: int) -> tuple[tuple[int, int], ...]:
    """The keys of the request's full blocks at token scale `factor` (module doc)."""
    run = BLOCK_TOKENS * factor  # trace tokens per sent block
    covered = request.block_size * len(request.block_ids)
    keys = []
    for j in range(covered // run):
        last = run * (j + 1) - 1
        index = last // request.block_size
        keys.append((int(request.block_ids[index]), last - index * request.block_size))
    return tuple(keys)


def prompt_for(request: TraceRequest, scope: str, label: str, scale: Scale) -> Prompt:
    """Request `request` of block id space `scope` as a prompt; `label` names the request
    (its fresh tail's seed: unique per session instance and turn)."""
    keys = scaled_blocks(request, scale.tokens)
    total = max(round(request.input_tokens / scale.tokens), BLOCK_TOKENS * len(keys))
    tail = total - BLOCK_TOKENS * len(keys)
    content = lead_pad() + "".join(block_text(scope, k) for k in keys) + fresh_text(label, tail)
    out = max(1, round(request.output_tokens / scale.tokens))
    return Prompt(content, keys, tail, out)
