"""``python -m e2e.cluster up|down|status``: the CLI of :mod:`e2e.cluster.stack`."""

from __future__ import annotations

import sys

from e2e.cluster.stack import main

sys.exit(main())
