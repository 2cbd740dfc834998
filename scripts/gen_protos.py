"""Generate paramserver/api/v1/*_pb2.py, *_pb2_grpc.py and their typed *.pyi stubs from protos/.

The one generator script (run by ``make protos`` and by the setup.py build hook). The ``.pyi``
stubs come from mypy-protobuf's protoc plugins (``protoc-gen-mypy`` for the messages,
``protoc-gen-mypy_grpc`` for the aio stubs and servicers), so ``mypy --strict`` checks every use
of a message field, an enum value and an RPC against the protos.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def _plugin(name: str) -> str:
    """The path of a protoc plugin executable installed with mypy-protobuf."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(
            f"{name} not found: install mypy-protobuf (pinned in build-system.requires and the "
            "dev extra)"
        )
    return found


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
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={root}",
        f"--grpc_python_out={root}",
        f"--mypy_out=quiet:{root}",
        f"--mypy_grpc_out=quiet:{root}",
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
