"""``paramserver`` with a checkpoint failpoint: the process SIGKILLs itself at a chosen point of
its first checkpoint write. Run by path (not collected)::

    python failpoint_server.py POINT serve ARGS...

A checkpoint is written in a fixed order (``CheckpointManager.write`` in
:mod:`paramserver.server.checkpoint`): temporary directory, tensor file (safetensors writes a
hidden temporary file and renames it when complete), fsync, manifest, fsync, atomic rename of
the directory, directory fsync, pruning, WAL truncation. ``POINT`` picks where the process dies:

``tensors:F``
    while the tensor file is being written: the checkpoint's temporary directory holds only a
    torn temporary file with the first fraction F of the tensor file's bytes (what a kill part
    way through safetensors' write leaves);
``manifest``
    the tensor file is complete and fsynced, the manifest not written;
``rename``
    every file written and fsynced, the directory not yet renamed into place;
``committed``
    right after the rename (before the directory fsync, pruning and WAL truncation).

Everything else is the real daemon (``paramserver.cli.main.main``), so the crash is a real SIGKILL
of a
real server process at a known point, independent of how fast this host writes files.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
    """Patch the checkpoint writer of this process to die at ``point``."""
    from paramserver.server import checkpoint

    real_save = checkpoint.save_file
    real_rename = os.rename

    if point.startswith("tensors:"):
        fraction = float(point.split(":", 1)[1])

        def torn_save(tensors: Any, filename: str, metadata: Any = None) -> None:
            path = Path(filename)
            real_save(tensors, str(path))
            torn = path.with_name(".tmpfailpoint")
            real_rename(path, torn)
            os.truncate(torn, int(torn.stat().st_size * fraction))
            _die()

        checkpoint.save_file = torn_save
    elif point == "manifest":

        def save_then_die(tensors: Any, filename: str, metadata: Any = None) -> None:
            real_save(tensors, filename)
            with open(filename, "rb") as fh:
                os.fsync(fh.fileno())
            _die()

        checkpoint.save_file = save_then_die
    elif point in ("rename", "committed"):

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if Path(src).name.startswith(".tmp-ckpt-"):
                if point == "committed":
                    real_rename(src, dst, *args, **kwargs)
                _die()
            real_rename(src, dst, *args, **kwargs)

        os.rename = rename
    else:
        raise SystemExit(f"unknown failpoint {point!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from paramserver.cli.main import main

    sys.exit(main(sys.argv[2:]))
