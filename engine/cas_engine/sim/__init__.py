"""``cas_engine.sim``: a CPU stand-in for SGLang workers (a SIMULATOR, never a model).

The sim speaks the SGLang worker HTTP API and metrics so the SGLang router (PD mode), the
operator and the anomaly loop can run end to end without a GPU. It runs the real ``cas_engine``
cores where they exist (``kvfence`` reclaim ledger/write tracker, ``guard`` quality gate) and a
timing model in place of a model forward pass.

Modules (data flow top to bottom):

- :mod:`.config`    SGLang-named CLI arguments + ``--sim-*`` options -> one frozen ``SimConfig``.
- :mod:`.textgen`   deterministic word tokenizer and seeded token generator (replays are equal).
- :mod:`.prefix_cache` radix-style block prefix cache; hit rates come from the traffic.
- :mod:`.timing`    prefill/decode cost model, calibrated defaults and their sources.
- :mod:`.faults`    fault settings (CLI ``--sim-fault`` and ``POST /sim/fault``).
- :mod:`.kvpool`    the decode KV pool (numpy, registered with mooncake) and expected contents.
- :mod:`.pd`        prefill<->decode bootstrap protocol and mooncake TCP transfers.
- :mod:`.reclaim`   slot release policy (Immediate / Upstream / Strict) on the decode side.
- :mod:`.worker`    the scheduler: queues, prefill, decode batch loop, guard, metrics.
- :mod:`.metrics`   ``sglang:*`` and ``cas_sim_*`` metrics on the worker's registry.
- :mod:`.server`    aiohttp routes (``/generate``, OpenAI endpoints, health, info, metrics).
- :mod:`.fleet`     router + prefill + decode sims as local processes (tests, demo).
- :mod:`.load`      the coding-agent load generator (``python -m cas_engine.sim.load``).

Run: ``python -m cas_engine.sim --disaggregation-mode decode --port 30001 --sim-speedup 10``;
a whole fleet with load: ``python -m cas_engine.sim.load --launch`` (needs ``sglang-router``).
"""

SIMULATOR_NOTICE = "cas_engine.sim: simulated worker (no model); output text is synthetic"
