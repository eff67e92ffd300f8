#!/usr/bin/env python3
"""Make the project's virtualenv fast from a fresh clone: third-party packages in one cached
virtualenv, the checkout in a thin one layered over it (`make setup` runs this).

Data flow: ``pyproject.toml`` (dependencies, the extras asked for, the build backend's
requirements), the requirements file and the ``--no-deps`` pins, with the Python version, make a
key. Under ``$CAS_VENV_DIR`` (default ``~/.cache/cas-operator/venvs``) ``<key>`` holds every
third-party package, built once by pip (its own cache makes a rebuild cheaper) under a file lock,
so clones and worktrees build it at most once between them; it is never changed after its
``.complete`` marker is written. The checkout's ``VENV`` is then a plain virtualenv without pip
whose ``_cas_deps.pth`` adds the cached site-packages (with their own ``.pth`` files) behind its
own; the checkout is installed there in editable mode, so each clone imports its own code. For
every console script of the cached virtualenv (pytest, mypy, lint-imports...) ``VENV/bin`` gets
a wrapper that runs it with ``VENV``'s Python, and a link for each native one (ruff, hadolint).

Only the two most recently used cached virtualenvs are kept. ``CAS_VENV_CACHE=0`` builds a
self-contained ``VENV`` as before (pip and every package inside it).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP = 2  # cached virtualenvs kept (the current one and the one before)
MARK = ".complete"
SKIP_SCRIPTS = {"python", "python3", f"python3.{sys.version_info.minor}", "activate"}


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())
    optional = project["project"].get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"venv: no such extras in {pyproject}: {', '.join(unknown)}")
    build = project.get("build-system", {}).get("requires", [])
    deps = project["project"].get("dependencies", [])
    return [*deps, *(r for e in extras for r in optional[e]), *build]


def cache_key(reqs: list[str], req_file: Path, no_deps: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"{sys.version}\n{os.path.realpath(sys.executable)}\n".encode())
    for line in [*reqs, "--", req_file.read_text(), "--", *no_deps]:
        h.update(line.encode() + b"\n")
    return h.hexdigest()[:16]


def site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


def run(*argv: str | Path) -> None:
    subprocess.run([str(a) for a in argv], check=True)


def build_full(venv: Path, reqs: list[str], req_file: Path, no_deps: list[str]) -> None:
    """One resolver run for every requirement, then the --no-deps pins (as `make setup` did)."""
    run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(py, "-m", "pip", "install", "-q", *reqs, "-r", req_file)
    if no_deps:
        run(py, "-m", "pip", "install", "-q", "--no-deps", *no_deps)


def cached_deps(cache: Path, key: str, reqs: list[str], req_file: Path, no_deps: list[str]) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    deps = cache / key
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (deps / MARK).exists():
            print(f"venv: building the cached third-party virtualenv {deps} (once per "
                  "dependency change)", flush=True)  # fmt: skip
            shutil.rmtree(deps, ignore_errors=True)
            started = time.monotonic()
            build_full(deps, reqs, req_file, no_deps)
            (deps / MARK).write_text(f"built in {time.monotonic() - started:.0f} s\n")
        os.utime(deps / MARK)  # last used: what pruning keeps
    prune(cache, keep=deps)
    return deps


def prune(cache: Path, keep: Path) -> None:
    """Remove all but the KEEP most recently used cached virtualenvs; one in use by another
    build (its lock held) is left alone."""
    done = [d for d in cache.iterdir() if (d / MARK).exists() and d != keep]
    done.sort(key=lambda d: (d / MARK).stat().st_mtime, reverse=True)
    for old in done[KEEP - 1 :]:
        with open(cache / f"{old.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(old, ignore_errors=True)
        (cache / f"{old.name}.lock").unlink(missing_ok=True)


def thin(venv: Path, deps: Path) -> None:
    """VENV: a virtualenv without pip over DEPS' site-packages, the checkout installed editable."""
    if venv.exists() and any(venv.iterdir()) and not (venv / "pyvenv.cfg").exists():
        raise SystemExit(f"venv: {venv} is not empty and not a virtualenv; not replacing it")
    shutil.rmtree(venv, ignore_errors=True)
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    deps_site = site_packages(deps)
    (site_packages(venv) / "_cas_deps.pth").write_text(
        f"import site; site.addsitedir({str(deps_site)!r})\n"
    )
    wrap_scripts(venv, deps)
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps",
        "--no-build-isolation", "-e", ROOT)  # fmt: skip
    (venv / ".cas-deps").write_text(f"{deps}\n")


def wrap_scripts(venv: Path, deps: Path) -> None:
    py = (venv / "bin" / "python").absolute()
    for script in sorted((deps / "bin").iterdir()):
        name = script.name
        target = venv / "bin" / name
        if name in SKIP_SCRIPTS or name.startswith(("activate", "Activate")) or target.exists():
            continue
        with open(script, "rb") as f:
            head = f.readline()
        if head.startswith(b"#!") and b"python" in head:
            target.write_text(f'#!/bin/sh\nexec "{py}" "{script}" "$@"\n')
            target.chmod(0o755)
        else:
            target.symlink_to(script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=Path)
    ap.add_argument("--extras", default="dev,operator,engine")
    ap.add_argument("--requirements", type=Path, required=True)
    ap.add_argument("--no-deps", nargs="*", default=[], help="pins installed without dependencies")
    args = ap.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    reqs = requirements(ROOT / "pyproject.toml", extras)
    if os.environ.get("CAS_VENV_CACHE", "1") == "0":
        shutil.rmtree(args.venv, ignore_errors=True)
        project = f"{ROOT}[{','.join(extras)}]" if extras else str(ROOT)
        build_full(args.venv, ["-e", project, *reqs], args.requirements, args.no_deps)
        return
    cache = Path(os.environ.get("CAS_VENV_DIR", Path.home() / ".cache" / "cas-operator" / "venvs"))
    key = cache_key(reqs, args.requirements, args.no_deps)
    deps = cached_deps(cache, key, reqs, args.requirements, args.no_deps)
    started = time.monotonic()
    thin(args.venv, deps)
    print(f"venv: {args.venv} over {deps} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
