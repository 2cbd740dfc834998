"""The write-ahead log's record types live in one registry (paramserver/server/wal_records.py):
nothing else builds a record, and every body the proto declares has a replay entry."""

from __future__ import annotations

import re
from pathlib import Path

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.server.wal_records import RECORD_TYPES

PACKAGE = Path(__file__).resolve().parents[2] / "paramserver"
#: A record or a record body built with fields (``WalRecord(push=...)``, ``WalPush(...)``).
_BUILDS = re.compile(r"\bWal[A-Z][A-Za-z]*\((?!\))")


def test_no_record_is_built_outside_the_registry() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("api/") or rel == "server/wal_records.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "wal_pb" in line and _BUILDS.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert found == []


def test_every_record_body_has_exactly_one_replay_entry() -> None:
    bodies = {f.name for f in wal_pb.WalRecord.DESCRIPTOR.oneofs_by_name["body"].fields}
    assert set(RECORD_TYPES) == bodies
