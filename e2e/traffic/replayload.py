"""Real sessions for `make run --trace PATH`: one `bench.replay` per resource, started once the
resource answers, read by the live view.

Data flow: the trace's session starts (a `bench.replay.sources.Source`, read once; every
fleet gets the same) -> per resource, a thread that asks `router_url(name)` until the fleet
answers (its entry Service in `make run`), then runs a `bench.replay.client.Replay` through it
in a thread of its own (token counts and think times scaled by `scale`, the bound over
`pools[name]` tokens: that resource's prefills times the sims' capacity) -> `summaries()`:
each replay's snapshot (requests, errors, achieved hit rate and the bound, TTFT), for the view.

Bounded: the source's session starts and `duration_s`; `stop()` ends every replay at once.
Ownership: a TraceReplays owns its threads and replays.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.replay.client import Replay, ReplayConfig, progress_line
from bench.replay.prompts import Scale
from bench.replay.sources import Source


@dataclass
class TraceReplays:
    """See the module docstring. `models`: resource name -> served model name; `pools`:
    resource name -> its prefills' prefix cache together (tokens)."""

    source: Source
    models: dict[str, str]
    pools: dict[str, int]
    router_url: Callable[[str], str | None]
    scale: Scale
    duration_s: float = 3600.0
    ttft_slo_s: float = 0.2
    replays: dict[str, Replay] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> TraceReplays:
        for name in sorted(self.models):
            thread = threading.Thread(target=self._run, args=(name,), name=f"replay-{name}",
                                      daemon=True)  # fmt: skip
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, name: str) -> None:
        deadline = time.monotonic() + 600
        while not self._stop.is_set() and time.monotonic() < deadline:
            url = self.router_url(name)
            if url:
                config = ReplayConfig(
                    url=url, model=self.models[name], pool_capacity_tokens=self.pools[name],
                    scale=self.scale, duration_s=self.duration_s, ttft_slo_s=self.ttft_slo_s,
                )  # fmt: skip
                with self._lock:
                    if self._stop.is_set():
                        return
                    self.replays[name] = Replay(config, self.source).start_thread()
                return
            self._stop.wait(2.0)

    def summaries(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            replays = dict(self.replays)
        return {name: r.snapshot() for name, r in replays.items()}

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            replays = list(self.replays.values())
        for replay in replays:
            replay.stop()
        for thread in self._threads:
            thread.join(5.0)


def replay_line(summary: dict[str, Any]) -> str:
    """One line of the view: the replay's progress, its hit rate beside the bound."""
    return progress_line(summary)
