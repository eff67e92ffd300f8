"""Calibration of the quality gate's accept-rate rule: ``python -m bench.guard_calibration``.

The gate aborts a request whose speculative accept rate passes ``max_accept_rate`` (0.96) as
degenerate repetition. Coding agents also produce output a draft model predicts nearly token
for token: verbatim copies of files, boilerplate, repeated test cases. This runs the real
:class:`~cas_engine.guard.GuardMonitor` over requests of each kind, with the rate alone and
with the repetition rule (the output must also repeat with a short period), and prints the
share of requests each aborts:

- healthy: ``normal`` (the sim's text, accept probability 0.75), ``copy`` (a verbatim copy of
  this repository's Python source, as the sim's ``copy`` style), ``boilerplate`` (the chart's
  YAML templates and the samples), ``repeated tests`` (one assertion per line, the numbers
  changing), each at an accept probability above the limit (0.985, 0.975, 0.97);
- faulty: ``repetition`` (the sim's repeated phrase, 0.998) and ``corruption`` (the sim's
  garbled text, accept probability 0.05).

Accept counts per verify step are Bernoulli chains as in the sim (3 draft tokens per step);
the probabilities are assumptions stated here, the token sequences are real text. Writes
``bench/results/guard_calibration.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cas_engine.guard import GuardConfig, GuardMonitor
from cas_engine.sim.textgen import _WORD, TokenStream, token_id

ROOT = Path(__file__).resolve().parent.parent
DRAFTS = 3  # proposed draft tokens per verify step


def words_of(paths: Sequence[Path]) -> list[int]:
    ids: list[int] = []
    for path in paths:
        ids += [token_id(w) for w in _WORD.findall(path.read_text(encoding="utf-8"))]
    return ids


def repeated_tests(n: int) -> list[int]:
    lines = [f"    assert parse_line('row {i}: {i * 7}') == ({i}, {i * 7})\n" for i in range(n)]
    return [token_id(w) for w in _WORD.findall("".join(lines))]


def from_corpus(corpus: list[int]) -> Callable[[random.Random, int], list[int]]:
    def take(rng: random.Random, n: int) -> list[int]:
        start = rng.randrange(max(1, len(corpus) - n))
        return corpus[start : start + n]

    return take


def from_stream(style: str) -> Callable[[random.Random, int], list[int]]:
    def take(rng: random.Random, n: int) -> list[int]:
        stream = TokenStream(rng.getrandbits(32))
        stream.set_style(style)
        stream.take(n)
        return list(stream.ids)

    return take


def run_class(
    tokens_of: Callable[[random.Random, int], list[int]],
    accept_prob: float,
    *,
    requests: int,
    length: int,
    with_tokens: bool,
    seed: int,
) -> int:
    """Requests of one kind through the monitor; returns how many it aborted."""
    rng = random.Random(seed)
    monitor = GuardMonitor(GuardConfig(), capacity=1)
    trips = 0
    for i in range(requests):
        output = tokens_of(rng, length)
        slot = monitor.allocate(f"r{i}")
        made = 0
        while made < len(output):
            acc = 0
            while acc < DRAFTS and rng.random() < accept_prob:
                acc += 1
            made = min(len(output), made + acc + 1)
            seen = output[:made]
            tokens = (lambda _slot, seen=seen: seen) if with_tokens else None
            if monitor.observe_one(slot, acc, DRAFTS, tokens) is not None:
                trips += 1
                break
        monitor.finish(slot)
    return trips


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.guard_calibration")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--out", type=Path, default=Path("bench/results/guard_calibration.json"))
    args = p.parse_args(argv)
    logging.getLogger("cas_engine.guard").setLevel(logging.ERROR)  # a line per trip otherwise
    python = sorted((ROOT / "operator" / "cas_operator").rglob("*.py"))
    yaml_files = sorted((ROOT / "charts").rglob("*.yaml")) + sorted(
        (ROOT / "config").rglob("*.yaml")
    )
    classes = [
        ("normal", "healthy", from_stream("normal"), 0.75),
        ("copy", "healthy", from_corpus(words_of(python)), 0.985),
        ("boilerplate", "healthy", from_corpus(words_of(yaml_files)), 0.975),
        ("repeated tests", "healthy", from_corpus(repeated_tests(400)), 0.97),
        ("repetition", "faulty", from_stream("repeat"), 0.998),
        ("corruption", "faulty", from_stream("garbled"), 0.05),
    ]
    results = []
    for name, kind, tokens_of, prob in classes:
        row = {"class": name, "kind": kind, "accept_prob": prob, "requests": args.requests}
        for rule, with_tokens in (("rate_alone", False), ("rate_and_period", True)):
            trips = run_class(tokens_of, prob, requests=args.requests, length=args.tokens,
                              with_tokens=with_tokens, seed=1)  # fmt: skip
            row[rule] = round(trips / args.requests, 4)
        results.append(row)
    print(f"{'class':<16} {'kind':<8} {'accept p':>8} {'rate alone':>11} {'+ period':>9}")
    for r in results:
        print(f"{r['class']:<16} {r['kind']:<8} {r['accept_prob']:>8} "
              f"{r['rate_alone']:>11.2%} {r['rate_and_period']:>9.2%}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
