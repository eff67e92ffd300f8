"""Entry point ``python -m cas_engine.launch_server <sglang args> [--cas-* flags]``.

Everything else lives in :mod:`cas_engine.launch`. One thing must happen here, before any
import that pulls in ``prometheus_client``: SGLang runs prometheus-client in multiprocess mode
(every process writes its metrics to files in ``PROMETHEUS_MULTIPROC_DIR``, ``/metrics`` merges
them), and prometheus-client picks its storage when it is first imported. Our launcher and
SGLang's plugin hook import it before SGLang sets that variable, so we set it first; SGLang
then reuses it (it only creates a directory when the variable is unset).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_prometheus_multiproc_dir() -> str:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` to a fresh directory unless already set; return it."""
    if os.environ.get(MULTIPROC_ENV):
        return os.environ[MULTIPROC_ENV]
    path = tempfile.mkdtemp(prefix="cas-engine-prometheus-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ[MULTIPROC_ENV] = path
    return path


if __name__ == "__main__":
    prepare_prometheus_multiproc_dir()
    from cas_engine.launch import main

    sys.exit(main())
