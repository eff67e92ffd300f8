"""Entry point ``python -m cas_engine.launch_server <sglang args> [--cas-* flags]``.

Everything lives in :mod:`cas_engine.launch`.
"""

from __future__ import annotations

import sys

from cas_engine.launch import main

if __name__ == "__main__":
    sys.exit(main())
