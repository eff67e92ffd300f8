"""Where the repository is, for the harness modules that read ``crds/``, ``config/samples/``
or write under ``run/`` (one definition, so moving a module does not move the root)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
