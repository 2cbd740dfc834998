"""The object tier (G4): a pluggable, content-addressed object store.

Keys are ``"{rank}/{sequence_hash:016x}"`` (:func:`paramserver.spmd.hashing.object_key`).
Objects are immutable: a key, once committed, is never overwritten. Concurrent puts of one key
(case ``concurrent-object-puts.md``): the first *complete* write commits, every other writer of
that key succeeds with "already present"; a reader sees either nothing or the whole object,
never a part; a writer that dies mid-stream leaves nothing visible.

:class:`FilesystemObjectStore` (the default backend) implements that with a private temp file
per writer under ``<root>/.tmp/``, ``fsync``, then ``os.link(temp, final)``: ``link`` is atomic
and fails with ``EEXIST`` when the key is already committed, so the first commit wins without a
lock and without replacing a committed object (``rename`` would replace it). The temp name is
then unlinked and the key's directory fsynced. Temp files of writers that died are removed by
:meth:`FilesystemObjectStore.sweep_temp`.

Another backend (S3, a KV service) implements :class:`ObjectStore`.
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from paramserver.spmd.transfer_errors import ObjectNotFound

__all__ = ["FilesystemObjectStore", "ObjectStore", "ObjectWriter"]

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^(0|[1-9][0-9]{0,8})/[0-9a-f]{16}$")


def _check_key(key: str) -> None:
    if not _KEY_RE.match(key):
        raise ValueError(f"object key {key!r} is not '{{rank}}/{{sequence_hash:016x}}'")


class ObjectWriter(abc.ABC):
    """One in-progress put: write chunks in order, then :meth:`commit` or :meth:`abort`."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the object being written."""

    @abc.abstractmethod
    def commit(self) -> bool:
        """Make the object visible atomically.

        Returns:
            True when this writer committed the key; False when the key was already committed
            (the write is discarded and the caller reports "already present").
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the write; nothing becomes visible (idempotent)."""


class ObjectStore(abc.ABC):
    """A content-addressed, immutable object store (the G4 interface). Thread-safe."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Size of the committed object in bytes, or ``None`` when absent."""

    @abc.abstractmethod
    def begin_put(self, key: str) -> ObjectWriter:
        """Start writing ``key``; nothing is visible until :meth:`ObjectWriter.commit`."""

    @abc.abstractmethod
    def read_into(self, key: str, out: memoryview) -> int:
        """Read the whole object into ``out``.

        Returns:
            The object size in bytes.

        Raises:
            ObjectNotFound: absent (NOT_FOUND).
            ValueError: the object's size differs from ``len(out)``.
        """

    @abc.abstractmethod
    def iter_chunks(self, key: str, chunk_bytes: int) -> tuple[int, Iterator[bytes]]:
        """The object's size in bytes and an iterator of its chunks of at most ``chunk_bytes``.

        Raises:
            ObjectNotFound: absent (NOT_FOUND).
        """

    def has(self, key: str) -> bool:
        """True when ``key`` is committed."""
        return self.size(key) is not None

    def free_bytes(self) -> int | None:
        """Bytes a new object may still take, or ``None`` when the backend cannot tell."""
        return None

    def put(self, key: str, data: bytes | memoryview) -> bool:
        """Write and commit ``data`` under ``key``; True if stored, False if already present."""
        writer = self.begin_put(key)
        try:
            writer.write(data)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    def get(self, key: str) -> bytes:
        """The whole object.

        Raises:
            ObjectNotFound: absent (NOT_FOUND).
        """
        size = self.size(key)
        if size is None:
            raise ObjectNotFound(f"object {key} not found")
        out = bytearray(size)
        self.read_into(key, memoryview(out))
        return bytes(out)

    @property
    def writes_in_progress(self) -> int:
        """Uncommitted writers of this store object."""
        return 0


class _FsWriter(ObjectWriter):
    def __init__(self, store: FilesystemObjectStore, key: str) -> None:
        self._store = store
        self._key = key
        self._tmp = store.temp_dir / f"{uuid.uuid4().hex}.part"
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._done = False
        store._writer_started()

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            raise ValueError("write after commit/abort")
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._store._writer_finished()

    def commit(self) -> bool:
        if self._fd is None:
            raise ValueError("commit after commit/abort")
        fd, self._fd = self._fd, None
        try:
            if self._store.durable:
                os.fsync(fd)
            os.close(fd)
            final = self._store.path_of(self._key)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(self._tmp, final)
                created = True
            except FileExistsError:
                created = False
            if created and self._store.durable:
                _fsync_dir(final.parent)
            return created
        finally:
            _unlink_quietly(self._tmp)
            self._finish()

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        _unlink_quietly(self._tmp)
        self._finish()


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemObjectStore(ObjectStore):
    """Objects as files ``<root>/<rank>/<sequence_hash:016x>``; temp files in ``<root>/.tmp``.

    Args:
        root: directory of the store (shared by every rank and instance that should see the
            same objects).
        durable: fsync every object and its directory before it becomes visible.
    """

    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = root.resolve()
        self.temp_dir = self.root / ".tmp"
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self._lock = threading.Lock()
        self._writers = 0

    def free_bytes(self) -> int | None:
        """Bytes free to an unprivileged writer on the store's filesystem (``statvfs``)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def path_of(self, key: str) -> Path:
        """File path of ``key``.

        Raises:
            ValueError: malformed key.
        """
        _check_key(key)
        return self.root / key

    def _writer_started(self) -> None:
        with self._lock:
            self._writers += 1

    def _writer_finished(self) -> None:
        with self._lock:
            self._writers -= 1

    @property
    def writes_in_progress(self) -> int:
        with self._lock:
            return self._writers

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self.path_of(key)).st_size
        except FileNotFoundError:
            return None

    def begin_put(self, key: str) -> ObjectWriter:
        _check_key(key)
        return _FsWriter(self, key)

    def read_into(self, key: str, out: memoryview) -> int:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"object {key} not found") from None
        try:
            size = os.fstat(fd).st_size
            if size != len(out):
                raise ValueError(f"object {key} has {size} bytes, expected {len(out)}")
            done = 0
            while done < size:
                n = os.preadv(fd, [out[done:]], done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short read of object {key}")
                done += n
            return size
        finally:
            os.close(fd)

    def iter_chunks(self, key: str, chunk_bytes: int) -> tuple[int, Iterator[bytes]]:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"object {key} not found") from None
        size = os.fstat(fd).st_size

        def chunks() -> Iterator[bytes]:
            try:
                pos = 0
                while pos < size:
                    data = os.pread(fd, min(chunk_bytes, size - pos), pos)
                    if not data:
                        raise OSError(errno.EIO, f"short read of object {key}")
                    pos += len(data)
                    yield data
            finally:
                os.close(fd)

        return size, chunks()

    def sweep_temp(self, older_than_s: float = 0.0) -> int:
        """Remove temp files of dead writers older than ``older_than_s`` seconds.

        Returns:
            Files removed.
        """
        now = time.time()
        removed = 0
        for entry in self.temp_dir.glob("*.part"):
            try:
                if now - entry.stat().st_mtime >= older_than_s:
                    entry.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed
