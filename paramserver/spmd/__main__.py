"""``python -m paramserver.spmd rank-server|spmd-demo`` (used by the launcher)."""

from __future__ import annotations

import sys

from paramserver.spmd.cli import main

if __name__ == "__main__":
    sys.exit(main())
