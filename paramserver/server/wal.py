"""Write-ahead log of a server shard: every mutation, written before it is applied and durable
before the reply.

The log is a sequence of segment files ``wal-<first sequence>.log``; each record is framed as::

    uint32 little-endian payload length | uint32 little-endian CRC-32 of payload | payload

with the payload a serialized :class:`paramserver.api.v1.wal_pb2.WalRecord`, built by
:mod:`paramserver.server.wal_records` (every record type's encoding and replay, one
registry). Records carry a strictly increasing sequence number. A crash while
appending leaves a torn tail (short read or CRC mismatch); it is cut off on open, and since a
record is acknowledged only after the fsync that covers it, nothing acknowledged is ever in it.

Order of a mutation: validate, **write the record** (to the OS, :meth:`WriteAheadLog.append`),
apply it in memory, then await :meth:`WriteAheadLog.durable` and only then acknowledge. A
write that fails (ENOSPC, EIO) is cut back off the segment and the request is refused with
nothing applied (:class:`~paramserver.errors.StorageFull` / ``StorageError``), so a refused
request changes nothing, in memory or on disk. An fsync that fails leaves memory possibly ahead
of the disk: the log is marked failed and the server stops accepting mutations (and worker
pulls) until it is restarted, when the log it replays is again the truth.

Durability is a group commit (as in database logs, e.g. PostgreSQL's ``commit_delay``): one
flusher task fsyncs everything appended so far (off the event loop thread), optionally after
waiting ``fsync_interval_ms`` to gather more records, and then releases every waiter it
covered. A pull that runs between a push's apply and its fsync may read the push before it is
acknowledged (it is in the OS's page cache then, so a process crash does not lose it).

Recovery = newest checkpoint + replay of every record after the checkpoint's sequence
(:func:`paramserver.server.wal_records.replay_into`). A checkpoint rotates the log at its
snapshot (a new segment starts with the next record), and once the checkpoint commits the
older segments are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.errors import ParamServerError, StorageError, storage_error

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")
_PREFIX = "wal-"
_SUFFIX = ".log"


class WalError(ParamServerError):
    """A log that cannot be opened or replayed."""


def _segment_first(path: Path) -> int:
    return int(path.name[len(_PREFIX) : -len(_SUFFIX)])


class WriteAheadLog:
    """Segmented, CRC-framed, group-committed append-only log.

    Args:
        directory: Where segments live (created if missing).
        fsync_interval_ms: Extra wait before each group fsync, to batch more records (0: fsync
            as soon as a record waits). ``None`` disables fsync (the OS flushes when it likes:
            survives a process kill, not a power cut).
    """

    def __init__(self, directory: Path, *, fsync_interval_ms: float | None = 0.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync_interval_ms = fsync_interval_ms
        self.next_sequence = 1
        self.appended_bytes = 0
        self.fsyncs = 0
        self._fd: int | None = None
        self._segment: Path | None = None
        self._written = 0
        self._synced = 0
        self._flusher: asyncio.Task[None] | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: Bytes in the open segment (where a failed append is cut back to).
        self._size = 0
        #: Set once the log can no longer be trusted to hold every applied record (an fsync
        #: failed, or a partial record could not be cut off): every later append raises it.
        self.failed: StorageError | None = None
        #: Told the serialized records of every successful append, in sequence order (the
        #: shard's mutation stream, which replication sends to the backups).
        self.on_append: Callable[[list[bytes]], None] | None = None

    # ------------------------------------------------------------------ reading
    def segments(self) -> list[Path]:
        """Segment files, oldest first."""
        return sorted(
            (p for p in self.directory.iterdir() if p.name.startswith(_PREFIX)),
            key=_segment_first,
        )

    @staticmethod
    def _payloads(path: Path) -> Iterator[tuple[memoryview, int]]:
        """CRC-checked payloads of one segment (views, no copies) with the offset just past
        each; stops at a torn tail."""
        with open(path, "rb") as fh:
            data = memoryview(fh.read())
        offset = 0
        while offset + _FRAME.size <= len(data):
            length, crc = _FRAME.unpack_from(data, offset)
            start = offset + _FRAME.size
            payload = data[start : start + length]
            if len(payload) < length or zlib.crc32(payload) != crc:
                return
            offset = start + length
            yield payload, offset

    def _read_segment(self, path: Path) -> Iterator[tuple[wal_pb.WalRecord, int]]:
        """Valid records of one segment with the offset just past each; stops at a torn tail."""
        for payload, offset in self._payloads(path):
            record = wal_pb.WalRecord()
            try:
                record.ParseFromString(payload)  # type: ignore[arg-type]  # upb parses any buffer
            except Exception:  # a CRC collision on garbage; treat as torn
                return
            yield record, offset

    def replay(self, after_sequence: int = 0) -> Iterator[wal_pb.WalRecord]:
        """Every valid record with sequence > ``after_sequence``, in order."""
        last = after_sequence
        for seg in self.segments():
            for record, _ in self._read_segment(seg):
                if record.sequence <= last:
                    continue
                last = record.sequence
                yield record

    # ------------------------------------------------------------------ writing
    def open(self) -> int:
        """Open for appending after the last valid record (cutting a torn tail off).

        Returns:
            The sequence number of the last valid record (0 when empty).
        """
        last = 0
        segs = self.segments()
        for seg in segs:
            end = 0
            tail: memoryview | None = None
            for tail, end in self._payloads(seg):  # noqa: B007 - only the last one is parsed
                pass
            if tail is not None:  # records are in sequence order: the last holds the largest
                record = wal_pb.WalRecord()
                try:
                    record.ParseFromString(tail)  # type: ignore[arg-type]  # upb parses any buffer
                except Exception:  # a CRC collision on garbage: parse them all, stop before it
                    end = 0
                    for record, end in self._read_segment(seg):  # noqa: B007
                        pass
                last = max(last, record.sequence)
            if seg.stat().st_size != end:
                logger.warning(
                    "WAL segment %s: cutting a torn tail of %d bytes (never acknowledged)",
                    seg.name,
                    seg.stat().st_size - end,
                )
                os.truncate(seg, end)
        self.next_sequence = last + 1
        if segs:
            self._open_segment(segs[-1])
        else:
            self._open_segment(self.directory / f"{_PREFIX}{self.next_sequence:016d}{_SUFFIX}")
        # What the log holds is durable from here on (one fsync of the open segment covers
        # records a crash left in the page cache only; older segments were synced when they
        # were rotated), so a retry of a logged request is answered without waiting.
        if self._fd is not None:
            os.fsync(self._fd)
        self._written = self._synced = last
        return last

    def _open_segment(self, path: Path) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segment = path
        self._size = os.fstat(self._fd).st_size
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def append(self, record: wal_pb.WalRecord) -> int:
        """Assign the next sequence, write the framed record to the OS, return the sequence.

        Call it before applying the mutation; it is not yet durable: await :meth:`durable`
        with the returned sequence before acknowledging.

        Raises:
            StorageFull: (RESOURCE_EXHAUSTED) the disk is full (ENOSPC, EDQUOT).
            StorageError: (UNAVAILABLE) another write error, or the log failed before.
            In both cases the log is as it was before the call (a partial record is cut off)
            and the caller must not apply the mutation.
        """
        return self.append_many([record])

    def append_many(self, records: list[wal_pb.WalRecord]) -> int:
        """Append several records as one write: all of them, or (on a write error) none.

        What one all-or-nothing mutation logs as several records (a push to several tables,
        one record per table) goes through here, so a failed write never leaves part of it
        in the log. A crash in the middle of the write may leave a prefix of the records on
        disk; none of them was acknowledged, and the client's retry of the same request ids
        completes the rest (the logged ones are answered as duplicates).

        Returns:
            The last record's sequence (0 for no records).

        Raises:
            StorageFull / StorageError: as :meth:`append`; nothing of the records is in the log.
        """
        if not records:
            return 0
        self._check_writable()
        now = time.time()
        frames = []
        payloads = []
        for i, record in enumerate(records):
            record.sequence = self.next_sequence + i
            record.unix_s = now
            payload = record.SerializeToString()
            payloads.append(payload)
            frames.append(_FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
        self._write(b"".join(frames), len(records))
        seq = int(records[-1].sequence)
        self._written = seq
        if self.on_append is not None:
            self.on_append(payloads)
        return seq

    def append_copies(self, records: list[tuple[int, bytes]]) -> int:
        """Append records another log wrote (a backup copying its primary's stream), keeping
        their sequence numbers and bytes; one write, all or none.

        Args:
            records: ``(sequence, serialized WalRecord)`` pairs; the first sequence must be
                :attr:`next_sequence` and the rest consecutive.

        Returns:
            The last record's sequence (0 for no records).

        Raises:
            WalError: a sequence out of order (the stream and this log disagree).
            StorageFull / StorageError: as :meth:`append`; nothing of the records is written.
        """
        if not records:
            return 0
        self._check_writable()
        for i, (seq, _) in enumerate(records):
            if seq != self.next_sequence + i:
                raise WalError(
                    f"replicated record {seq} does not follow this log's "
                    f"{self.next_sequence + i - 1}"
                )
        self._write(
            b"".join(_FRAME.pack(len(p), zlib.crc32(p)) + p for _, p in records), len(records)
        )
        self._written = records[-1][0]
        return self._written

    def restart_at(self, last_sequence: int) -> None:
        """Drop every segment and continue with a new one after ``last_sequence`` (a backup
        seeded with its primary's state at that sequence; the seed's checkpoint holds it).

        Call it only with no :meth:`durable` waiter pending.
        """
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for seg in self.segments():
            seg.unlink()
        self.next_sequence = last_sequence + 1
        self._written = self._synced = last_sequence
        self._open_segment(self.directory / f"{_PREFIX}{self.next_sequence:016d}{_SUFFIX}")

    def _check_writable(self) -> None:
        """Refuse a write to a log that failed (StorageError) or is not open (WalError)."""
        if self.failed is not None:
            raise StorageError(self.failed.message)
        if self._fd is None:
            raise WalError("write-ahead log is not open")

    def _write(self, blob: bytes, count: int) -> None:
        """Write ``count`` framed records in one go and advance the marks, or (on an error)
        cut them back off and raise StorageFull / StorageError with the log as it was."""
        assert self._fd is not None
        view = memoryview(blob)
        start = self._size
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            self._cut_back(start, exc)
            raise storage_error(exc, f"write-ahead log {self._segment}: write") from exc
        self._size = start + len(blob)
        self.next_sequence += count
        self.appended_bytes += len(blob)

    def _cut_back(self, size: int, cause: OSError) -> None:
        """Cut a partially written record off the open segment (a write failed midway)."""
        try:
            if self._fd is not None:
                os.ftruncate(self._fd, size)
        except OSError as exc:
            self.failed = StorageError(
                f"write-ahead log {self._segment}: a write failed ({cause}) and the partial "
                f"record could not be cut off ({exc}); restart the server"
            )
            raise self.failed from exc

    async def durable(self, sequence: int) -> None:
        """Return once the record ``sequence`` (and all before it) is fsynced.

        Raises:
            StorageError: (UNAVAILABLE) the fsync failed; :attr:`failed` is set from then on.
        """
        if self.fsync_interval_ms is None or sequence <= self._synced:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((sequence, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(
                self._flush(), name="paramserver-wal-flusher"
            )
        await fut

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiters:
            if self.fsync_interval_ms:
                await asyncio.sleep(self.fsync_interval_ms / 1000.0)
            target = self._written
            try:
                if self._fd is not None:
                    # A duplicate descriptor: a rotation (a checkpoint's cut) may close the
                    # segment's own one while this fsync runs in its thread, and a descriptor
                    # opened then may reuse that number; the duplicate keeps naming the segment
                    # that holds records up to ``target``.
                    fd = os.dup(self._fd)
                    try:
                        await loop.run_in_executor(None, os.fsync, fd)
                    finally:
                        os.close(fd)
                    self.fsyncs += 1
            except OSError as exc:
                self.failed = StorageError(
                    f"write-ahead log {self._segment}: fsync failed "
                    f"({errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror}); "
                    "records after the last sync may be lost, so this server accepts no more "
                    "mutations: restart it"
                )
                for _, fut in self._waiters:
                    if not fut.done():
                        fut.set_exception(StorageError(self.failed.message))
                self._waiters.clear()
                return
            self._synced = max(self._synced, target)
            keep = []
            for seq, fut in self._waiters:
                if seq <= self._synced:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((seq, fut))
            self._waiters = keep

    def rotate(self) -> int:
        """Start a new segment at the next sequence; returns the last sequence before it.

        Called at a checkpoint's snapshot: the checkpoint reflects every record up to the
        returned sequence, so once it commits, :meth:`truncate_through` may drop them.
        """
        last = self.next_sequence - 1
        if self._fd is not None:
            os.fsync(self._fd)
            self._synced = max(self._synced, self._written)
        self._open_segment(self.directory / f"{_PREFIX}{self.next_sequence:016d}{_SUFFIX}")
        return last

    def truncate_through(self, sequence: int) -> int:
        """Delete segments whose records all have sequence <= ``sequence``; returns the count."""
        segs = self.segments()
        removed = 0
        for seg, nxt in itertools.pairwise(segs):
            if _segment_first(nxt) - 1 <= sequence and seg != self._segment:
                seg.unlink()
                removed += 1
        return removed

    async def close(self) -> None:
        """Flush, fsync and close."""
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
