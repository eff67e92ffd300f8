"""Where the repository is, for the harness modules that read ``crds/``, ``config/samples/``
or write under ``run/`` (one definition, so moving a module does not move the root), and the
one way the harness records its state there (`write_json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically: a reader (or a crash) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
