"""Build hook: generate the gRPC/protobuf modules from protos/ before packaging.

The generated ``paramserver/api/v1/*_pb2*.py`` files are never committed; ``make protos``
and every ``pip install`` (regular or editable) create them with the pinned grpcio-tools.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        from gen_protos import generate

        generate(ROOT)
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
