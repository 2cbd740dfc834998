"""Generate paramserver/api/v1/*_pb2.py, *_pb2_grpc.py and *.pyi from protos/.

The one generator script (run by ``make protos`` and by the setup.py build hook).
"""

from __future__ import annotations

import sys
from pathlib import Path


def generate(root: Path) -> None:
    from grpc_tools import protoc  # pinned in build-system.requires and the dev extra

    proto_root = root / "protos"
    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_root}")
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={root}",
        f"--grpc_python_out={root}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    for pkg in ("paramserver/api", "paramserver/api/v1"):
        init = root / pkg / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated wire types (from protos/); never edited by hand."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
