"""Deterministic tokenizer and token generator (synthetic text, never a model's output).

- Tokenizer: a prompt's UTF-8 bytes in 4-byte chunks, each chunk one token id (uint32). Trivial,
  fast (numpy, no Python loop) and identical in every process, so prefill and decode agree on
  the token ids and therefore on the expected KV digest.
- Generator: a request's seed is a digest of its prompt tokens, its sampling seed and the
  worker's ``--sim-seed``; the i-th output token depends only on that seed and i, so a replay of
  the same request yields the same text whatever the batching or timing.
- Failure styles: ``garbled`` draws from rare characters (what corrupted KV looks like in
  production); ``repeat`` cycles a short phrase (degenerate repetition). ``copy`` is healthy:
  a verbatim copy of real source code (this package's own files), which a draft model predicts
  nearly token for token, so its accept rate is as high as repetition's while its tokens do
  not repeat with a short period.
- Token ids: each stream keeps the ids of its last ``KEPT_IDS`` tokens (``ids``), what the
  quality gate's repetition rule reads (a stable hash per word).
"""

from __future__ import annotations

import hashlib
import random
import re
import zlib
from collections import deque
from functools import cache
from pathlib import Path

import numpy as np

KEPT_IDS = 512
_WORD = re.compile(r"\w+|[^\w\s]|\n")


@cache
def code_corpus() -> tuple[str, ...]:
    """Words of this package's own source files, in order: the text a ``copy`` reproduces."""
    words: list[str] = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        words += _WORD.findall(path.read_text(encoding="utf-8"))
    return tuple(words)


def token_id(piece: str) -> int:
    """A stable id of one token piece (the same in every process)."""
    return zlib.crc32(piece.encode("utf-8"))


_WORDS = (
    "def",
    "return",
    "self",
    "if",
    "else",
    "for",
    "in",
    "while",
    "import",
    "from",
    "class",
    "with",
    "as",
    "try",
    "except",
    "raise",
    "yield",
    "lambda",
    "None",
    "True",
    "False",
    "and",
    "or",
    "not",
    "is",
    "pass",
    "break",
    "continue",
    "async",
    "await",
    "print",
    "len",
    "range",
    "list",
    "dict",
    "set",
    "tuple",
    "str",
    "int",
    "float",
    "open",
    "read",
    "write",
    "path",
    "file",
    "test",
    "assert",
    "value",
    "key",
    "items",
    "result",
    "data",
    "config",
    "request",
    "response",
    "error",
    "status",
    "update",
    "create",
    "delete",
    "build",
    "run",
    "check",
    "parse",
    "load",
    "save",
    "index",
    "count",
    "name",
    "type",
    "args",
    "kwargs",
    "token",
    "batch",
    "cache",
    "prefix",
    "decode",
    "prefill",
    "slot",
    "room",
    "fence",
    "guard",
    "metric",
    "label",
    "pod",
    "node",
    "worker",
    "router",
    "queue",
    "state",
    "event",
    "log",
    "time",
    "step",
)
_CODE_PUNCT = ("(", ")", ":", "=", ".", ",", "[", "]", "\n", "    ", "+=", "->", "==", "#")
VOCAB: tuple[str, ...] = tuple(_WORDS) + _CODE_PUNCT
GARBLE: tuple[str, ...] = (
    "\u0bf5",
    "\ua66e",
    "\u2e3b",
    "\u16dd",
    "\u0e5b",
    "\ufffd",
    "\u2fd5",
    "\u1f00\u0334",
    "\u0489",
    "\u2603\u0336",
    "\u02ac",
    "\u0f12",
)
_REPEAT_CYCLE = ("the", "same", "line", "again", "\n")


def tokenize(text: str) -> np.ndarray:
    """Token ids of ``text``: its UTF-8 bytes zero-padded to a multiple of 4, as uint32."""
    raw = text.encode("utf-8")
    pad = (-len(raw)) % 4
    return np.frombuffer(raw + b"\0" * pad, dtype="<u4")


def request_seed(tokens: np.ndarray, sampling_seed: int | None, worker_seed: int) -> int:
    """64-bit seed of a request: prompt tokens + sampling seed + worker seed."""
    h = hashlib.blake2b(
        tokens.tobytes(), digest_size=8, key=f"{worker_seed}:{sampling_seed}".encode()
    )
    return int.from_bytes(h.digest(), "little")


class TokenStream:
    """Yields a request's output tokens (as text pieces) in order; owned by one request."""

    __slots__ = ("_copy_at", "_rng", "_style", "count", "ids")

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._style = "normal"
        self.count = 0
        self.ids: deque[int] = deque(maxlen=KEPT_IDS)
        self._copy_at = seed % max(1, len(code_corpus()))

    def set_style(self, style: str) -> None:
        """``normal``, ``garbled`` (corrupted KV), ``repeat`` (degenerate repetition) or
        ``copy`` (a verbatim copy of source code: healthy)."""
        self._style = style

    def take(self, n: int) -> list[str]:
        """The next ``n`` token pieces."""
        out: list[str] = []
        for _ in range(n):
            r = self._rng.getrandbits(16)  # drawn in every style: a replay stays aligned
            if self._style == "garbled":
                piece = GARBLE[r % len(GARBLE)]
            elif self._style == "repeat":
                piece = _REPEAT_CYCLE[self.count % len(_REPEAT_CYCLE)]
            elif self._style == "copy":
                corpus = code_corpus()
                piece = corpus[(self._copy_at + self.count) % len(corpus)]
            else:
                piece = VOCAB[r % len(VOCAB)]
            out.append(piece)
            self.ids.append(token_id(piece))
            self.count += 1
        return out


def join_pieces(pieces: list[str]) -> str:
    """Text of token pieces (space separated, newlines and indents kept as they are)."""
    return "".join(p if p in ("\n", "    ") else p + " " for p in pieces)
