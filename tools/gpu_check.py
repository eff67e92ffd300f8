#!/usr/bin/env python3
"""One-shot GPU check (``make gpu-check``): CUDA tests, the HiCache race on real streams, costs.

Run on a CUDA machine from the repository root through ``tools/gpu-check.sh`` (it installs the
wheels in ``.whl/`` and sets ``PYTHONPATH``), or directly::

    python3 tools/gpu_check.py --out /tmp/gpu-check            # on the GPU machine
    python3 tools/gpu_check.py --out /tmp/gpu-check --cpu-dry-run   # anywhere: CPU parts only

Checks, in order, each bounded by a timeout (the whole run by ``--budget-s``, 270 s):

- ``versions``: nvidia-smi's GPU name, driver and CUDA version; Python, torch, torch's CUDA,
  the GPU torch sees, numpy, pytest, prometheus-client.
- ``cuda_available``: torch sees a CUDA device (fails on the device mode otherwise).
- ``pytest_gpu``: ``tests/engine/test_hicache.py -m gpu`` (the only CUDA tests in tests/); on a
  CUDA machine a skipped test is a failure.
- ``pytest_hicache_cpu``: the rest of that file on the same interpreter (real-SGLang tests skip).
- ``hicache_race``: :class:`cas_engine.hicache.cuda_probe.CudaLoadProbe` trials with and without
  the per-layer wait, over several layer counts / buffer sizes / injected delays: reads the
  detector flagged, layers actually read stale, stale reads it missed. Passes when the wait gives
  no stale read, the detector misses no stale read, and the race shows up where a delay is
  injected. With ``--cpu-dry-run`` it runs the CPU stand-in (``cpu_loader``) instead.
- ``hicache_wait_cost``: per-layer forward-stream time with vs without the wait (CUDA events),
  loads already complete (the wait's own cost) and overlapping (the wait also stalls).
- ``guard_overhead``: ``bench/guard_overhead.py`` (numpy / lists / SGLang hook feeds) plus
  feeds from CUDA tensors (device-to-host copy + observe, and the copy alone).

Each part but the pytest runs and nvidia-smi runs in a child process (``--part NAME``) so a hang
or a CUDA crash costs one check, not the run. Writes ``OUT/gpu-check.json`` after every check
and prints a summary table. Exit status: 0 all passed (skips only with ``--cpu-dry-run``), 1 a
check failed, 3 the run hit its time budget.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parent.parent
SRC_PATHS = [REPO / "engine", REPO / "operator", REPO]
for _p in reversed(SRC_PATHS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

PASS, FAIL, SKIP = "pass", "fail", "skip"
GPU_TESTS = ["tests/engine/test_hicache.py"]  # grep: the only tests that need CUDA
MIN_GPU_TESTS = 2  # test_cuda_streams_read_before_ready[False|True]
MIN_TRIALS = 10  # per config and mode, or the race check fails
GUARD_BATCHES = [1, 64, 256]

# (name, layers, elements per layer (float32), injected delay in GPU clock cycles per layer)
RACE_CONFIGS: list[tuple[str, int, int, int]] = [
    ("4L x 4MiB, delay 20M cyc", 4, 1 << 20, 20_000_000),  # the pytest's shape
    ("8L x 1MiB, delay 2M cyc", 8, 1 << 18, 2_000_000),
    ("32L x 256KiB, delay 200k cyc", 32, 1 << 16, 200_000),
    ("16L x 16MiB, no delay", 16, 1 << 22, 0),  # only the copies themselves: informational
]
# CPU stand-in for --cpu-dry-run: (name, layers, seconds per layer)
STANDIN_CONFIGS: list[tuple[str, int, float]] = [
    ("cpu 4L, 1 ms", 4, 0.001),
    ("cpu 16L, 0.2 ms", 16, 0.0002),
]
WAIT_COST_SHAPE = (32, 1 << 20)  # layers, elements (4 MiB per layer)

# part -> hard timeout cap (s); the real timeout is also bounded by what is left of the budget
PART_CAPS = {"versions": 60, "race": 120, "waitcost": 60, "guard": 90}
PYTEST_CAPS = {"pytest_gpu": 120, "pytest_hicache_cpu": 60}


# ---------------------------------------------------------------------------- helpers


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in SRC_PATHS]
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths + old)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], *, timeout: float, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd`` in its own process group, output to ``log``; kill the group on timeout."""
    t0 = time.monotonic()
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            rc = proc.wait(timeout=10)
        except BaseException:  # the run's own alarm, Ctrl-C: take the child down too
            _kill(proc)
            proc.wait(timeout=10)
            raise
    return {
        "cmd": cmd,
        "rc": rc,
        "timed_out": timed_out,
        "timeout_s": round(timeout, 1),
        "seconds": round(time.monotonic() - t0, 2),
        "log": str(log),
    }


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


# ---------------------------------------------------------------------------- child parts


def part_versions(args: argparse.Namespace) -> dict[str, Any]:
    data: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "packages": {
            n: _dist_version(n) for n in ("numpy", "pytest", "prometheus-client", "pytest-timeout")
        },
    }
    try:
        import torch
    except Exception as exc:  # torch absent or broken: record why
        data["torch"] = None
        data["torch_error"] = f"{type(exc).__name__}: {exc}"
        return {"status": PASS, "reason": "recorded (torch not importable)", "data": data}
    data["torch"] = torch.__version__
    data["torch_cuda"] = torch.version.cuda
    t0 = time.monotonic()
    avail = bool(torch.cuda.is_available())
    data["cuda_available"] = avail
    data["device_count"] = torch.cuda.device_count() if avail else 0
    if avail:
        props = torch.cuda.get_device_properties(0)
        data["gpu"] = torch.cuda.get_device_name(0)
        data["capability"] = list(torch.cuda.get_device_capability(0))
        data["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        data["sm_count"] = props.multi_processor_count
        torch.zeros(1, device="cuda").sum().item()  # initialise the context
        data["cuda_init_s"] = round(time.monotonic() - t0, 2)
        cudnn = torch.backends.cudnn
        data["cudnn"] = cudnn.version() if cudnn.is_available() else None
    return {"status": PASS, "reason": "recorded", "data": data}


def _quiet_detector_log() -> None:
    import logging

    logging.getLogger("cas_engine.hicache").setLevel(logging.CRITICAL)  # one line per violation


def _empty_mode() -> dict[str, Any]:
    return {
        "trials": 0,
        "layers_read": 0,
        "violations": 0,
        "trials_with_violation": 0,
        "stale_layers": 0,
        "trials_with_stale": 0,
        "missed_stale_layers": 0,
        "false_alarms": 0,
        "seconds": 0.0,
    }


def _add_trial(
    m: dict[str, Any], layers: int, flagged: set[int], stale: set[int], dt: float
) -> None:
    m["trials"] += 1
    m["layers_read"] += layers
    m["violations"] += len(flagged)
    m["trials_with_violation"] += bool(flagged)
    m["stale_layers"] += len(stale)
    m["trials_with_stale"] += bool(stale)
    m["missed_stale_layers"] += len(stale - flagged)
    m["false_alarms"] += len(flagged - stale)
    m["seconds"] = round(m["seconds"] + dt, 3)


def _run_trials(
    configs: list[dict[str, Any]],
    trial: Callable[[dict[str, Any], bool], tuple[set[int], set[int]]],
    *,
    trials: int,
    budget_s: float,
) -> None:
    """Interleave no-wait / wait trials per config until ``trials`` each or its time share."""
    t_end = time.monotonic() + budget_s
    for k, cfg in enumerate(configs):
        share = (t_end - time.monotonic()) / (len(configs) - k)
        stop = time.monotonic() + max(share, 0.0)
        modes = {"no_wait": _empty_mode(), "wait": _empty_mode()}
        cfg["results"] = modes
        for _ in range(trials):
            if time.monotonic() > stop:
                cfg["stopped_by_time"] = True
                break
            for name, wait in (("no_wait", False), ("wait", True)):
                t0 = time.perf_counter()
                flagged, stale = trial(cfg, wait)
                _add_trial(modes[name], cfg["layers"], flagged, stale, time.perf_counter() - t0)
        print(f"  {cfg['name']}: {json.dumps(modes)}", flush=True)


def _race_criteria(configs: list[dict[str, Any]], *, standin: bool) -> list[str]:
    failures = []
    for cfg in configs:
        r, name = cfg["results"], cfg["name"]
        for mode in ("wait", "no_wait"):
            if r[mode]["trials"] < MIN_TRIALS:
                failures.append(f"{name}: only {r[mode]['trials']} {mode} trials (< {MIN_TRIALS})")
        if r["wait"]["stale_layers"] or r["wait"]["violations"]:
            failures.append(
                f"{name}: with the wait, {r['wait']['stale_layers']} stale layers and "
                f"{r['wait']['violations']} flagged reads (both must be 0)"
            )
        if not standin and r["no_wait"]["missed_stale_layers"]:
            failures.append(
                f"{name}: the detector missed {r['no_wait']['missed_stale_layers']} stale reads"
            )
        caught = r["no_wait"]["violations"] > 0
        # the CPU stand-in copies no data: its "stale" is only "not yet loaded"
        shown = caught and (standin or r["no_wait"]["stale_layers"] > 0)
        if cfg["expect_race"] and not shown:
            failures.append(
                f"{name}: without the wait the race did not show "
                f"(violations {r['no_wait']['violations']}, stale {r['no_wait']['stale_layers']})"
            )
    return failures


def _cuda_reason() -> str | None:
    """None when torch sees CUDA, else why not."""
    try:
        import torch
    except Exception as exc:
        return f"torch not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def part_race(args: argparse.Namespace) -> dict[str, Any]:
    from cas_engine.hicache.detector import ReadBeforeReadyDetector

    _quiet_detector_log()
    reason = "--cpu-dry-run" if args.cpu_dry_run else _cuda_reason()
    if reason is not None:
        return _race_standin(args, f"CUDA race not run: {reason}")
    from cas_engine.hicache.cuda_probe import CudaLoadProbe

    configs: list[dict[str, Any]] = []
    probes: dict[str, CudaLoadProbe] = {}
    for name, layers, elements, delay in RACE_CONFIGS:
        probe = CudaLoadProbe(layers, elements)
        probes[name] = probe
        delay_us = probe.measure_delay_us(delay) if delay else 0.0
        configs.append(
            {
                "name": name,
                "layers": layers,
                "elements": elements,
                "bytes_per_layer": elements * 4,
                "delay_cycles": delay,
                "delay_us_measured": round(delay_us, 1),
                "expect_race": delay > 0,
            }
        )

    def trial(cfg: dict[str, Any], wait: bool) -> tuple[set[int], set[int]]:
        det = ReadBeforeReadyDetector(cfg["layers"])
        res = probes[cfg["name"]].trial(det, wait=wait, delay_cycles=cfg["delay_cycles"])
        return set(res.flagged), set(res.stale)

    _run_trials(configs, trial, trials=args.trials, budget_s=args.budget_s)
    failures = _race_criteria(configs, standin=False)
    return {
        "status": FAIL if failures else PASS,
        "reason": "; ".join(failures) if failures else "wait: no stale read; no-wait: caught",
        "data": {"mode": "cuda", "configs": configs, "failures": failures},
    }


def _race_standin(args: argparse.Namespace, reason: str) -> dict[str, Any]:
    """The same trials with the CPU loader thread (exercises this script without a GPU)."""
    from cas_engine.hicache.cpu_loader import LayerLoadCounter, run_layer_load
    from cas_engine.hicache.detector import ReadBeforeReadyDetector

    def trial(cfg: dict[str, Any], wait: bool) -> tuple[set[int], set[int]]:
        n = cfg["layers"]
        det = ReadBeforeReadyDetector(n)
        counter = LayerLoadCounter(n)
        loader = run_layer_load(counter, [cfg["delay_s"]] * n, detector=det)
        stale = set()
        for i in range(n):
            if wait:
                counter.wait_until(i, timeout=2.0)
                det.mark_waited(i)
            if not counter.is_ready(i):
                stale.add(i)
            det.record_read(i)
        loader.join(timeout=5)
        return {int(i) for i in det.violated_layers()}, stale

    configs: list[dict[str, Any]] = [
        {"name": name, "layers": layers, "delay_s": delay, "expect_race": True}
        for name, layers, delay in STANDIN_CONFIGS
    ]
    _run_trials(configs, trial, trials=min(args.trials, 30), budget_s=min(args.budget_s, 20.0))
    failures = _race_criteria(configs, standin=True)
    return {
        "status": FAIL if failures else SKIP,
        "reason": "; ".join(failures) if failures else f"{reason}; ran the CPU stand-in only",
        "data": {"mode": "cpu-standin", "configs": configs, "failures": failures},
    }


def part_waitcost(args: argparse.Namespace) -> dict[str, Any]:
    reason = "--cpu-dry-run" if args.cpu_dry_run else _cuda_reason()
    if reason is not None:
        return {"status": SKIP, "reason": f"needs CUDA events: {reason}", "data": {}}
    from cas_engine.hicache.cuda_probe import CudaLoadProbe

    layers, elements = WAIT_COST_SHAPE
    probe = CudaLoadProbe(layers, elements)
    combos = [(ov, w) for ov in (False, True) for w in (False, True)]
    warm_end = time.monotonic() + args.budget_s / 4
    for ov, w in combos * 3:  # warm-up, bounded like the rest
        if time.monotonic() > warm_end:
            break
        probe.timed_pass(wait=w, overlap=ov)
    samples: dict[tuple[bool, bool], dict[str, list[float]]] = {
        c: {"gpu": [], "host": [], "span": []} for c in combos
    }
    t_end = time.monotonic() + args.budget_s
    passes = 0
    while passes < args.wait_cost_passes and time.monotonic() < t_end:
        for ov, w in combos:
            t = probe.timed_pass(wait=w, overlap=ov)
            s = samples[(ov, w)]
            s["gpu"].extend(t.gpu_us)
            s["host"].append(t.host_us_per_layer)
            s["span"].append(t.span_us)
        passes += 1
    scenarios = {}
    for ov in (False, True):
        row: dict[str, Any] = {}
        for w in (False, True):
            s = samples[(ov, w)]
            row["wait" if w else "no_wait"] = {
                "median_gpu_us_per_layer": _median(s["gpu"]),
                "p90_gpu_us_per_layer": _quantile(s["gpu"], 0.9),
                "median_host_us_per_layer": _median(s["host"]),
                "median_span_us": _median(s["span"]),
                "layer_samples": len(s["gpu"]),
            }
        a, b = row["wait"]["median_gpu_us_per_layer"], row["no_wait"]["median_gpu_us_per_layer"]
        row["delta_median_gpu_us_per_layer"] = None if a is None or b is None else round(a - b, 3)
        ha, hb = row["wait"]["median_host_us_per_layer"], row["no_wait"]["median_host_us_per_layer"]
        row["delta_median_host_us_per_layer"] = (
            None if ha is None or hb is None else round(ha - hb, 3)
        )
        scenarios["overlap" if ov else "preloaded"] = row
    ok = passes >= 3
    return {
        "status": PASS if ok else FAIL,
        "reason": f"{passes} passes of {layers} layers" + ("" if ok else " (< 3)"),
        "data": {
            "layers": layers,
            "bytes_per_layer": elements * 4,
            "passes": passes,
            "scenarios": scenarios,
            "note": "preloaded: loads done before the pass (the wait's own cost); overlap: "
            "loads enqueued just before, no injected delay (the wait also stalls on the copy)",
        },
    }


def part_guard(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from bench import guard_overhead as go
    from cas_engine.guard import GuardConfig

    steps, repeats = args.guard_steps, args.guard_repeats
    result = go.run(GUARD_BATCHES, steps, repeats)  # numpy, lists, sglang feeds (CPU)
    rows: list[dict[str, Any]] = list(cast(list[dict[str, Any]], result["rows"]))
    reason = "--cpu-dry-run" if args.cpu_dry_run else _cuda_reason()
    if reason is None:
        import torch

        def time_cuda(batch: int, seed: int, copy_only: bool) -> tuple[list[float], float]:
            mon, slots = go._prepared_monitor(batch, GuardConfig())
            rng = np.random.default_rng(seed)
            acc = torch.from_numpy(rng.integers(1, 3, size=(steps, batch)).astype(np.int32))
            acc = acc.cuda()
            prop = np.full(batch, 3.0)
            torch.cuda.synchronize()

            def step(a: Any) -> list[Any]:
                host = a.cpu().numpy()  # the verify step's accept counts, device -> host
                return [] if copy_only else mon.observe(slots, host, prop)

            return go._measure(step, [(acc[k],) for k in range(steps)])

        for batch in GUARD_BATCHES:
            for feed, copy_only in (("cuda", False), ("cuda_copy_only", True)):
                runs = [time_cuda(batch, r, copy_only) for r in range(repeats)]
                medians = [statistics.median(w) * 1e6 for w, _ in runs]
                cpus = [c * 1e6 for _, c in runs]
                rows.append(
                    {
                        "batch": batch,
                        "input": feed,
                        "median_us": statistics.median(medians),
                        "cpu_us": statistics.median(cpus),
                        "per_request_ns": statistics.median(medians) * 1e3 / batch,
                        "repeat_medians_us": medians,
                        "repeat_cpu_us": cpus,
                    }
                )
    result["rows"] = rows
    met = bool(result["meets_target"])
    note = f"target < {go.TARGET_US_AT_256:.0f} us at batch 256 (CPU feeds): " + (
        "met" if met else "NOT met"
    )
    if reason is not None:
        return {
            "status": SKIP,
            "reason": f"CUDA-tensor feeds not run: {reason}; CPU feeds measured ({note})",
            "data": result,
        }
    return {"status": PASS, "reason": f"measured; {note}", "data": result}


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "versions": part_versions,
    "race": part_race,
    "waitcost": part_waitcost,
    "guard": part_guard,
}


def run_part(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        res = PARTS[args.part](args)
    except Exception as exc:
        res = {
            "status": FAIL,
            "reason": f"{type(exc).__name__}: {exc}",
            "data": {"traceback": traceback.format_exc()},
        }
        traceback.print_exc()
    res["seconds"] = round(time.monotonic() - t0, 2)
    Path(args.part_out).write_text(json.dumps(res, indent=2, default=str))
    return 0


# ---------------------------------------------------------------------------- the parent


class Report:
    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.dry_run = out, dry_run
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.doc: dict[str, Any] = {
            "tool": "tools/gpu_check.py",
            "mode": "cpu-dry-run" if dry_run else "device",
            "started": _now(),
            "host": socket.gethostname(),
            "repo": str(REPO),
            "git_commit": self._git_commit(),
            "budget_s": budget_s,
            "versions": {},
            "checks": [],
            "ok": None,
        }

    @staticmethod
    def _git_commit() -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            return out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, name: str, status: str, reason: str, seconds: float, **extra: Any) -> None:
        if status == SKIP and not self.dry_run:
            status, reason = FAIL, f"skipped on the device: {reason}"
        rec = {"name": name, "status": status, "reason": reason, "seconds": round(seconds, 2)}
        rec.update(extra)
        self.doc["checks"].append(rec)
        mark = {PASS: "PASS", FAIL: "FAIL", SKIP: "SKIP"}[status]
        print(f"[{mark}] {name} ({seconds:.1f} s): {reason}", flush=True)
        self.write()

    def write(self, final: bool = False) -> None:
        if final:
            self.doc["finished"] = _now()
            self.doc["wall_s"] = round(time.monotonic() - self.t0, 1)
            self.doc["failed"] = [c["name"] for c in self.doc["checks"] if c["status"] == FAIL]
            self.doc["skipped"] = [c["name"] for c in self.doc["checks"] if c["status"] == SKIP]
            self.doc["ok"] = not self.doc["failed"] and not self.doc.get("aborted")
        path = self.out / "gpu-check.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str))
        tmp.replace(path)


def _timeout_for(rep: Report, cap: float) -> float | None:
    left = rep.left() - 5
    return None if left < 10 else min(cap, left)


def _nvidia_smi() -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found on PATH"}
    info: dict[str, Any] = {"path": exe}
    fields = "index,name,driver_version,memory.total,compute_cap,pci.bus_id"
    for query in (fields, "index,name,driver_version,memory.total"):
        try:
            r = subprocess.run(
                [exe, f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
            return info
        if r.returncode == 0:
            keys = query.split(",")
            info["gpus"] = [
                dict(zip(keys, (v.strip() for v in line.split(",")), strict=False))
                for line in r.stdout.strip().splitlines()
            ]
            break
        info["error"] = (r.stderr or r.stdout).strip()[-500:]
    try:
        r = subprocess.run([exe], capture_output=True, text=True, timeout=20)
        m = re.search(r"CUDA Version:\s*([\d.]+)", r.stdout)
        info["cuda_version"] = m.group(1) if m else None
        info["header"] = "\n".join(r.stdout.splitlines()[:4])
    except (OSError, subprocess.SubprocessError) as exc:
        info["cuda_version_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _child(rep: Report, args: argparse.Namespace, part: str) -> dict[str, Any]:
    """Run ``--part part`` in a child; its JSON, or a failure saying why there is none."""
    timeout = _timeout_for(rep, PART_CAPS[part])
    if timeout is None:
        return {"status": FAIL, "reason": "not run: time budget spent", "seconds": 0.0}
    out_json = rep.out / f"part-{part}.json"
    out_json.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--part",
        part,
        "--part-out",
        str(out_json),
        "--out",
        str(rep.out),
        "--trials",
        str(args.trials),
        "--budget-s",
        str(max(timeout - 30, 5.0)),  # margin for imports, CUDA start-up, teardown
        "--guard-steps",
        str(args.guard_steps),
        "--guard-repeats",
        str(args.guard_repeats),
        "--wait-cost-passes",
        str(args.wait_cost_passes),
    ] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
    print(f"--- {part} (timeout {timeout:.0f} s)", flush=True)
    run = _run(cmd, timeout=timeout, log=rep.out / f"part-{part}.log", env=_child_env())
    log_tail = _tail(Path(run["log"]))
    if run["timed_out"]:
        return {
            "status": FAIL,
            "reason": f"timed out after {timeout:.0f} s",
            "seconds": run["seconds"],
            "log_tail": log_tail,
        }
    try:
        res: dict[str, Any] = json.loads(out_json.read_text())
    except (OSError, ValueError) as exc:
        return {
            "status": FAIL,
            "reason": f"child exited rc={run['rc']} without a result ({exc})",
            "seconds": run["seconds"],
            "log_tail": log_tail,
        }
    res["seconds"] = run["seconds"]
    if res.get("status") == FAIL:
        res["log_tail"] = log_tail
    return res


def _parse_junit(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:300]
                break
        cases.append(
            {
                "test": f"{tc.get('classname', '')}::{tc.get('name', '')}",
                "outcome": outcome,
                "seconds": float(tc.get("time") or 0.0),
                "message": message,
            }
        )
    counts = {
        k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")
    }
    return {"counts": counts, "cases": cases}


def _pytest(rep: Report, name: str, marker: str, *, require_run: bool) -> None:
    """Run GPU_TESTS with ``-m marker``; ``require_run``: a skip on CUDA is a failure."""
    timeout = _timeout_for(rep, PYTEST_CAPS[name])
    if timeout is None:
        rep.add(name, FAIL, "not run: time budget spent", 0.0)
        return
    xml = rep.out / f"{name}.xml"
    xml.unlink(missing_ok=True)
    env = _child_env()
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # whatever plugins the machine has stay out
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-c",
        str(REPO / "pyproject.toml"),
        "--rootdir",
        str(REPO),
        *GPU_TESTS,
        "-m",
        marker,
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
    ]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["-p", "pytest_timeout", f"--timeout={int(max(timeout - 10, 10))}"]
    print(f"--- {name}: {' '.join(cmd[2:])} (timeout {timeout:.0f} s)", flush=True)
    run = _run(cmd, timeout=timeout, log=rep.out / f"{name}.log", env=env)
    tail = _tail(Path(run["log"]), 15)
    print(tail, flush=True)
    extra: dict[str, Any] = {"run": run, "pytest": _dist_version("pytest"), "log_tail": tail}
    if run["timed_out"]:
        rep.add(name, FAIL, f"timed out after {timeout:.0f} s", run["seconds"], **extra)
        return
    try:
        junit = _parse_junit(xml)
    except (OSError, ET.ParseError) as exc:
        rep.add(name, FAIL, f"pytest rc={run['rc']}, no junit XML ({exc})", run["seconds"], **extra)
        return
    extra["junit"] = junit
    c = junit["counts"]
    total = sum(c.values())
    summary = (
        f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
    )
    reasons = sorted({x["message"] for x in junit["cases"] if x["outcome"] == "skipped"})
    if run["rc"] != 0 or c["failed"] or c["error"]:
        rep.add(name, FAIL, f"pytest rc={run['rc']}: {summary}", run["seconds"], **extra)
    elif require_run and total < MIN_GPU_TESTS:
        rep.add(
            name,
            FAIL,
            f"only {total} tests collected (< {MIN_GPU_TESTS}): {summary}",
            run["seconds"],
            **extra,
        )
    elif require_run and c["skipped"]:
        why = "; ".join(reasons)
        if rep.dry_run:
            rep.add(name, SKIP, f"{summary} ({why})", run["seconds"], **extra)
        else:
            rep.add(
                name,
                FAIL,
                f"GPU tests SKIPPED in device mode (CUDA required): {summary} ({why})",
                run["seconds"],
                **extra,
            )
    elif c["passed"] == 0:
        rep.add(name, FAIL, f"no test passed: {summary}", run["seconds"], **extra)
    else:
        rep.add(name, PASS, summary, run["seconds"], **extra)


def _record_child(rep: Report, name: str, res: dict[str, Any]) -> None:
    extra = {k: v for k, v in res.items() if k not in ("status", "reason", "seconds")}
    rep.add(name, res["status"], res["reason"], float(res.get("seconds", 0.0)), **extra)


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out, args.cpu_dry_run, args.budget_s)
    print(f"gpu-check: mode {rep.doc['mode']}, out {out}, budget {args.budget_s:.0f} s", flush=True)

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError("gpu-check ran past its time budget")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.budget_s) + 20)
    try:
        t0 = time.monotonic()
        smi = _nvidia_smi()
        ver = _child(rep, args, "versions")
        data = ver.get("data", {})
        rep.doc["versions"] = {"nvidia_smi": smi, **data}
        line = _versions_line(smi, data) if ver["status"] == PASS else ver["reason"]
        tail = {"log_tail": ver["log_tail"]} if "log_tail" in ver else {}
        rep.add("versions", ver["status"], line, time.monotonic() - t0, **tail)
        cuda = bool(data.get("cuda_available"))
        if cuda:
            rep.add("cuda_available", PASS, f"{data.get('device_count')} device(s)", 0.0)
        else:
            why = data.get("torch_error") or (
                f"torch {data.get('torch')} sees no CUDA device"
                if data.get("torch")
                else "torch not recorded"
            )
            rep.add("cuda_available", SKIP if args.cpu_dry_run else FAIL, why, 0.0)
        _pytest(rep, "pytest_gpu", "gpu", require_run=True)
        _pytest(rep, "pytest_hicache_cpu", "not gpu", require_run=False)
        for part, name in (
            ("race", "hicache_race"),
            ("waitcost", "hicache_wait_cost"),
            ("guard", "guard_overhead"),
        ):
            if not cuda and not args.cpu_dry_run and part != "guard":
                rep.add(name, FAIL, "not run: CUDA not available (see cuda_available)", 0.0)
                continue
            _record_child(rep, name, _child(rep, args, part))
    except (TimeoutError, KeyboardInterrupt) as exc:
        rep.doc["aborted"] = f"{type(exc).__name__}: {exc}"
        print(f"ABORTED: {rep.doc['aborted']}", flush=True)
    finally:
        signal.alarm(0)
    rep.write(final=True)
    print_summary(rep.doc)
    print(f"wrote {out / 'gpu-check.json'}", flush=True)
    if rep.doc.get("aborted"):
        return 3
    return 0 if rep.doc["ok"] else 1


def _versions_line(smi: dict[str, Any], v: dict[str, Any]) -> str:
    gpus = smi.get("gpus") or []
    g = gpus[0] if gpus else {}
    smi_part = (
        f"nvidia-smi: {g.get('name')}, driver {g.get('driver_version')}, "
        f"CUDA {smi.get('cuda_version')}"
        if g
        else f"nvidia-smi: {smi.get('error', 'no GPU listed')}"
    )
    torch_part = (
        f"torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), GPU {v.get('gpu', '-')}"
        if v.get("torch")
        else f"torch: {v.get('torch_error', 'not recorded')}"
    )
    return f"Python {v.get('python')}; {torch_part}; {smi_part}"


# ---------------------------------------------------------------------------- summary


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def print_summary(doc: dict[str, Any]) -> None:
    checks = {c["name"]: c for c in doc["checks"]}
    print()
    print(f"==== gpu-check summary ({doc['mode']}, {doc.get('wall_s')} s) ====")
    print(f"{'check':<20} {'status':<6} {'s':>6}  detail")
    for c in doc["checks"]:
        print(f"{c['name']:<20} {c['status'].upper():<6} {c['seconds']:>6.1f}  {c['reason']}")
    race = checks.get("hicache_race", {}).get("data", {})
    if race.get("configs"):
        print()
        print(
            f"HiCache load-use race ({race['mode']}): viol = reads the detector flagged, "
            "stale = layers read with wrong data, missed = stale and not flagged"
        )
        print(
            f"{'config':<30} {'mode':<8} {'trials':>6} {'reads':>6} {'viol':>6} {'stale':>6} "
            f"{'missed':>6} {'t_stale':>7} {'delay us':>9}"
        )
        for cfg in race["configs"]:
            for mode in ("no_wait", "wait"):
                r = cfg.get("results", {}).get(mode, {})
                print(
                    f"{cfg['name']:<30} {mode:<8} {r.get('trials', 0):>6} "
                    f"{r.get('layers_read', 0):>6} {r.get('violations', 0):>6} "
                    f"{r.get('stale_layers', 0):>6} {r.get('missed_stale_layers', 0):>6} "
                    f"{r.get('trials_with_stale', 0):>7} "
                    f"{_fmt(cfg.get('delay_us_measured', cfg.get('delay_s', 0) * 1e6)):>9}"
                )
    wc = checks.get("hicache_wait_cost", {}).get("data", {})
    if wc.get("scenarios"):
        print()
        print(
            f"Per-layer wait cost ({wc['layers']} layers x {wc['bytes_per_layer'] >> 20} MiB, "
            f"{wc['passes']} passes; CUDA events, median us per layer)"
        )
        print(
            f"{'scenario':<10} {'gpu no-wait':>11} {'gpu wait':>9} {'delta':>7} "
            f"{'host no-wait':>12} {'host wait':>9} {'span no-wait':>12} {'span wait':>10}"
        )
        for sc, row in wc["scenarios"].items():
            nw, w = row["no_wait"], row["wait"]
            print(
                f"{sc:<10} {_fmt(nw['median_gpu_us_per_layer'], 2):>11} "
                f"{_fmt(w['median_gpu_us_per_layer'], 2):>9} "
                f"{_fmt(row['delta_median_gpu_us_per_layer'], 2):>7} "
                f"{_fmt(nw['median_host_us_per_layer'], 2):>12} "
                f"{_fmt(w['median_host_us_per_layer'], 2):>9} "
                f"{_fmt(nw['median_span_us']):>12} {_fmt(w['median_span_us']):>10}"
            )
    guard = checks.get("guard_overhead", {}).get("data", {})
    if guard.get("rows"):
        feeds = list(dict.fromkeys(r["input"] for r in guard["rows"]))
        print()
        print("Quality-gate overhead per verify step (median wall us)")
        print(f"{'batch':>6} " + " ".join(f"{f:>14}" for f in feeds))
        for b in dict.fromkeys(r["batch"] for r in guard["rows"]):
            by = {r["input"]: r["median_us"] for r in guard["rows"] if r["batch"] == b}
            print(f"{b:>6} " + " ".join(f"{_fmt(by.get(f)):>14}" for f in feeds))
    print()
    verdict = "PASS" if doc.get("ok") else "FAIL"
    if doc.get("aborted"):
        verdict = f"ABORTED ({doc['aborted']})"
    failed = ", ".join(doc.get("failed") or []) or "none"
    skipped = ", ".join(doc.get("skipped") or []) or "none"
    print(f"RESULT: {verdict}  (failed: {failed}; skipped: {skipped})")


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-check")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run only what needs no CUDA; CUDA parts are reported as skipped with the reason",
    )
    p.add_argument("--budget-s", type=float, default=270.0, help="whole run (default 270)")
    p.add_argument("--trials", type=int, default=200, help="race trials per config and mode")
    p.add_argument("--guard-steps", type=int, default=1000)
    p.add_argument("--guard-repeats", type=int, default=3)
    p.add_argument("--wait-cost-passes", type=int, default=50)
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        return run_part(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
