"""What LayerSplit buys a prefill instance at a fixed cache hit rate: model next to simulator.

Data flow: the glm5-fp8-h200 profile -> one prefill instance of TP 8 with CP 4, replicated KV
and LayerSplit -> for each context length at a 90% hit rate (the cached prefix on the host tier,
as it is between the turns of a long-context agent) the planner's saturated throughput
(`model.prefill_capacity`, mean value analysis of the resident-KV bound) and the simulator's
(`fleetsim.engine.kv_bounded_prefill`, the recursion the fleet simulator runs, fed Poisson
arrivals beyond capacity) -> gain = LayerSplit / replicated - 1 for each.

`sensitivity` repeats the model for smaller per-GPU KV budgets: the gain depends on how many
whole contexts fit per rank, so it shows where the published figures sit (docs/planner.md).
Called by `bench/planner.py` (``make bench-planner``); pure computation apart from its caller's
JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bench.fleetsim.engine import _Pool, kv_bounded_prefill
from cas_operator.autoscale import profiles as pf
from cas_operator.autoscale.model import InstanceProfile, prefill_capacity

CONTEXTS = (40_000, 80_000, 120_000)
HIT_RATE = 0.9
CONTEXT_PARALLEL = 4
PUBLISHED = {40_000: 0.10, 120_000: 1.32}  # production report: +10% at 40K to +132% at 120K


@dataclass(frozen=True)
class Layouts:
    replicated: InstanceProfile
    layer_split: InstanceProfile
    transfer_bytes_per_s: float


def layouts(spec: pf.ProfileSpec) -> Layouts:
    rep = pf.prefill_profile(spec, cp=CONTEXT_PARALLEL, layer_split=False)
    split = pf.prefill_profile(spec, cp=CONTEXT_PARALLEL, layer_split=True)
    decode = pf.decode_profile(spec)
    return Layouts(rep, split, min(rep.nic_bytes_per_s, decode.nic_bytes_per_s))


def simulated_throughput(
    prefill: InstanceProfile, context: float, transfer_bytes_per_s: float, seed: int, n: int = 3000
) -> float:
    """Requests/s one simulated instance completes under Poisson arrivals at twice its compute
    bound (the first third of the requests is warm-up)."""
    cached = HIT_RATE * context
    busy = prefill.prefill_time(context - cached, cached)
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(busy / 2.0, n))
    times = kv_bounded_prefill(
        np.zeros(n, dtype=np.int64),
        arrival,
        np.full(n, prefill.host_load_s_per_token * cached),
        np.full(n, busy),
        np.full(n, context * prefill.kv_bytes_per_token / transfer_bytes_per_s),
        np.full(n, context),
        prefill.kv_capacity_tokens,
        _Pool(1, 1),
    )
    sent = np.sort(times.sent)
    warm = n // 3
    return float((n - 1 - warm) / (sent[-1] - sent[warm]))


def _model(prefill: InstanceProfile, context: float, bw: float) -> Any:
    cached = HIT_RATE * context
    return prefill_capacity(prefill, context, cached, cached, bw)


def table(seed: int) -> list[dict[str, Any]]:
    """One row per context length at the profile's own numbers."""
    lay = layouts(pf.load_spec("glm5-fp8-h200"))
    rows = []
    for context in CONTEXTS:
        rep = _model(lay.replicated, context, lay.transfer_bytes_per_s)
        split = _model(lay.layer_split, context, lay.transfer_bytes_per_s)
        sim_rep = simulated_throughput(lay.replicated, context, lay.transfer_bytes_per_s, seed)
        sim_split = simulated_throughput(lay.layer_split, context, lay.transfer_bytes_per_s, seed)
        rows.append(
            {
                "context_tokens": context,
                "hit_rate": HIT_RATE,
                "gain_model": round(split.throughput_rps / rep.throughput_rps - 1.0, 4),
                "gain_sim": round(sim_split / sim_rep - 1.0, 4),
                "gain_published": PUBLISHED.get(context),
                "concurrency_replicated": rep.concurrency,
                "concurrency_layer_split": split.concurrency,
                "gpu_s_per_request": round(rep.busy_s, 3),
                "resident_idle_s_replicated": round(rep.idle_s, 3),
                "resident_idle_s_layer_split": round(split.idle_s, 3),
                "model_rps": [round(rep.throughput_rps, 4), round(split.throughput_rps, 4)],
                "sim_rps": [round(sim_rep, 4), round(sim_split, 4)],
            }
        )
    return rows


def sensitivity(budgets_gb: tuple[float, ...] = (16.0, 12.0, 8.0)) -> list[dict[str, Any]]:
    """The model's gain when each GPU has ``budget`` GB for KV instead of the profile's."""
    spec = pf.load_spec("glm5-fp8-h200")
    rows = []
    for budget in (spec.kv_bytes_per_gpu / 1e9, *budgets_gb):
        weights = spec.hbm_bytes_per_gpu * spec.mem_fraction_static - budget * 1e9
        lay = layouts(replace(spec, weight_bytes_per_gpu=weights))
        row: dict[str, Any] = {"kv_gb_per_gpu": round(budget, 1)}
        for context in CONTEXTS:
            rep = _model(lay.replicated, context, lay.transfer_bytes_per_s)
            split = _model(lay.layer_split, context, lay.transfer_bytes_per_s)
            gain = split.throughput_rps / rep.throughput_rps - 1.0 if rep.throughput_rps else None
            row[str(context)] = {
                "gain": None if gain is None else round(gain, 4),
                "concurrency": [rep.concurrency, split.concurrency],
            }
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], sens: list[dict[str, Any]]) -> str:
    out = [
        f"LayerSplit at a {HIT_RATE:.0%} hit rate (glm5-fp8-h200, TP 8, CP {CONTEXT_PARALLEL}, "
        "prefix on the host tier): saturated prefill throughput, LayerSplit / replicated - 1",
        "| context | in flight (repl / LS) | model | simulator | published |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        pub = r["gain_published"]
        out.append(
            f"| {r['context_tokens'] // 1000}K | {r['concurrency_replicated']} / "
            f"{r['concurrency_layer_split']} | {r['gain_model']:+.1%} | {r['gain_sim']:+.1%} | "
            f"{'' if pub is None else f'{pub:+.0%}'} |"
        )
    out += [
        "",
        "Model gain by KV budget per GPU (in flight replicated / LayerSplit):",
        "| KV GB per GPU | " + " | ".join(f"{c // 1000}K" for c in CONTEXTS) + " |",
        "|---|" + "---|" * len(CONTEXTS),
    ]
    for s in sens:
        cells = []
        for c in CONTEXTS:
            cell = s[str(c)]
            gain = "-" if cell["gain"] is None else f"{cell['gain']:+.1%}"
            cells.append(f"{gain} ({cell['concurrency'][0]} / {cell['concurrency'][1]})")
        out.append(f"| {s['kv_gb_per_gpu']} | " + " | ".join(cells) + " |")
    return "\n".join(out)
