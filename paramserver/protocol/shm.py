"""Same-host shared memory for the Session fast path: segments in ``/dev/shm`` shared by one
worker client and the server it talks to.

Lifecycle (no segment outlives both processes, whoever dies)::

    client: open(/dev/shm/paramserver-<pid>-<hex>, O_CREAT|O_EXCL) -> fallocate -> mmap
            -> write magic + random nonce into the header -> offer(name, nonce, size, regions)
    server: open -> fstat (regular file, offered size) -> mmap -> check magic + nonce
            -> unlink -> answer "accepted"        (mismatch / missing: "declined", no unlink)
    client: unlink (whatever the answer; a missing file is fine)

After that no file exists: the kernel frees the memory when the last mapping goes, so a killed
client or server leaks nothing. A client killed between create and offer leaves a file whose
name embeds its (now dead) pid; :func:`sweep_dead` (run when a client starts) removes it.

Long-lived segments (:class:`OwnedSegment`, the SPMD rank server's G2 host pool) follow the same
lifecycle, with the file kept while its owner lives, since same-host peers map it by name
whenever they copy (:meth:`MappedSegment.attach`; a peer never unlinks)::

    owner:  open(/dev/shm/paramserver-<kind>-<pid>-<hex>, O_CREAT|O_EXCL) -> flock(LOCK_SH)
            -> fallocate -> mmap ... close(): unlink -> unmap -> close (the lock goes)
    peer:   open -> fstat (regular file, at least the expected size) -> mmap

An owner that dies without closing (SIGKILL, a crash) leaves its file behind, its lock released
by the kernel. :func:`sweep_dead`, run by every worker client and every rank server as it
starts, removes each segment file whose creating pid is gone *and* whose lock nobody holds (the
lock keeps a live owner in another pid namespace safe); until then the file holds its memory.
No atexit hook and no resource tracker: the owner unlinks, or the next process to start does.

Layout of a segment::

    [0, 4096)                       header: magic (8 bytes), nonce (16 bytes)
    [push_offset, +push_size)       push region: the client writes gradients here
    [pull_offset, +pull_size)       pull region: the server writes pulled values here

Clients offer one exchange region as both (same offset and size; the server reads a request's
gradients before it writes any of its reply): a segment is as large as the largest request or
reply, not their sum. Regions that overlap without being identical are declined.

The file is not made with :mod:`multiprocessing.shared_memory`: its resource tracker unlinks
segments and warns about "leaks" on its own schedule (Python 3.11), which fights the protocol
above. Every slot reference coming from the peer is checked against its region before a view
is made (:meth:`Region.view`), so a malicious offset or size is an INVALID_ARGUMENT, never an
out-of-bounds access.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: Directory of the segments (a tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
#: Prefix of every segment's file name.
NAME_PREFIX = "paramserver-"
#: Bytes before the first region (magic and nonce live there).
HEADER_BYTES = 4096
#: Region offsets and sizes are multiples of this (cache-line and SIMD friendly).
ALIGN_BYTES = 64
#: First bytes of every segment.
MAGIC = b"PSSHM\x00v1"
NONCE_BYTES = 16
#: Largest segment a server maps (bytes): a sanity bound on an untrusted offer.
MAX_SEGMENT_BYTES = 1 << 40

_NAME_RE = re.compile(r"paramserver-(\d+)-([0-9a-f]{16})\Z")
#: The name of every segment of this module: a client's (no kind) or an owner's (``kind``,
#: e.g. ``g2``).
_ANY_NAME_RE = re.compile(r"paramserver-(?:([a-z][a-z0-9]*)-)?(\d+)-([0-9a-f]{16})\Z")
_KIND_RE = re.compile(r"[a-z][a-z0-9]*\Z")


class ShmDeclined(Exception):
    """A shared-memory offer the server cannot take (another host or container, a bad offer).

    Not a :class:`~paramserver.errors.ParamServerError`: it never reaches a client as an error,
    only as a declined :class:`ShmAnswer` with this message as the reason.
    """


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    """``n`` rounded up to a multiple of ``align`` (bytes)."""
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Region:
    """A byte range of a mapped segment (or of a packed inline batch's bytes).

    Attributes:
        buffer: The whole mapping (or the batch's ``bytes``/``bytearray``).
        offset_bytes: Start of the region in the mapping.
        size_bytes: Length of the region.
        name: ``push`` or ``pull``, named in errors.
    """

    buffer: mmap.mmap | bytearray | bytes
    offset_bytes: int
    size_bytes: int
    name: str

    def view(
        self,
        offset_bytes: int,
        size_bytes: int,
        dtype: np.dtype[np.generic],
        shape: tuple[int, ...],
    ) -> np.ndarray:
        """An ndarray over ``[offset_bytes, offset_bytes + size_bytes)`` of this region.

        Args:
            offset_bytes: Offset from the region's start (bytes).
            size_bytes: Payload bytes; must equal ``prod(shape) * dtype.itemsize``.
            dtype: Element type.
            shape: Dimensions.

        Returns:
            A writeable view (no copy) of dtype ``dtype`` and shape ``shape``.

        Raises:
            InvalidArgument: the slot is not inside the region or its size disagrees with
                the shape (INVALID_ARGUMENT).
        """
        count = 1
        for d in shape:
            if d < 0:
                raise InvalidArgument(f"shared-memory slot: negative dimension in {shape}")
            count *= d
        expected = count * dtype.itemsize
        if size_bytes != expected:
            raise InvalidArgument(
                f"shared-memory slot: size_bytes {size_bytes} != prod(shape {shape}) * "
                f"itemsize {dtype.itemsize} = {expected}"
            )
        if offset_bytes < 0 or offset_bytes + size_bytes > self.size_bytes:
            raise InvalidArgument(
                f"shared-memory slot [{offset_bytes}, {offset_bytes + size_bytes}) is outside "
                f"the {self.name} region of {self.size_bytes} bytes"
            )
        arr = np.frombuffer(
            self.buffer, dtype=dtype, count=count, offset=self.offset_bytes + offset_bytes
        )
        return arr.reshape(shape)


def _check_layout(
    size: int, push_offset: int, push_size: int, pull_offset: int, pull_size: int
) -> None:
    if size < HEADER_BYTES or size > MAX_SEGMENT_BYTES:
        raise ShmDeclined(f"segment size {size} outside [{HEADER_BYTES}, {MAX_SEGMENT_BYTES}]")
    spans = sorted([(push_offset, push_size), (pull_offset, pull_size)])
    if spans[0] == spans[1]:  # one exchange region for both directions
        spans = spans[:1]
    end = HEADER_BYTES
    for start, length in spans:
        if start < end or start + length > size:
            raise ShmDeclined(
                f"regions (push {push_offset}+{push_size}, pull {pull_offset}+{pull_size}) "
                f"overlap the header or each other (only identical regions may), or pass "
                f"the segment's {size} bytes"
            )
        end = start + length


def _close_mapping(buffer: mmap.mmap | None) -> None:
    if buffer is None:
        return
    # Views handed out (numpy arrays) keep the buffer exported: then the mapping goes when
    # the last view is garbage collected.
    with contextlib.suppress(BufferError):
        buffer.close()


def _create_file(path: Path, size: int, *, lock: bool) -> tuple[int, mmap.mmap]:
    """Create ``path`` (never an existing file), reserve ``size`` bytes and map them.

    With ``lock`` the creator takes a shared ``flock`` on the returned descriptor first: held
    while that descriptor is open, i.e. while the owner lives. The caller closes the descriptor.

    Raises:
        OSError: no such directory, no space (the memory is reserved up front with
            ``posix_fallocate``, so a full tmpfs fails here, not with SIGBUS later).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if lock:
            fcntl.flock(fd, fcntl.LOCK_SH)
        os.posix_fallocate(fd, 0, size)
        buffer = mmap.mmap(fd, size)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise
    return fd, buffer


class ClientSegment:
    """A segment created by a worker client (:meth:`create`), offered to one server.

    Attributes:
        name: File name in :data:`SHM_DIR` (``paramserver-<pid>-<hex>``).
        size_bytes: Segment size.
        push: The push region (client writes gradients).
        pull: The pull region (server writes pulled values).
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        nonce: bytes,
        buffer: mmap.mmap,
        push_size: int,
        pull_size: int,
    ) -> None:
        self.directory = directory
        self.name = name
        self.nonce = nonce
        self.size_bytes = len(buffer)
        self._buffer: mmap.mmap | None = buffer
        # One exchange region serves both directions: the server reads a request's tensors
        # (and applies them) before it writes any of its reply, and the client writes its next
        # request only after it has the reply. Half the memory of two regions.
        self.push = Region(buffer, HEADER_BYTES, push_size, "push")
        self.pull = Region(buffer, HEADER_BYTES, pull_size, "pull")
        #: Memo of the request layouts placed in and read from this mapping (views of it;
        #: ``memo`` of :func:`paramserver.protocol.session_frames.place_slot_batch` and
        #: ``slot_batch_views``), cleared on close.
        self.layouts: dict[str, object] = {}

    @classmethod
    def create(
        cls, push_size_bytes: int, pull_size_bytes: int, directory: Path = SHM_DIR
    ) -> ClientSegment:
        """Create, size and map a new segment with a fresh nonce.

        Args:
            push_size_bytes: Wanted push-region size (rounded up to :data:`ALIGN_BYTES`).
            pull_size_bytes: Wanted pull-region size (rounded up likewise).
            directory: Where the file goes (``/dev/shm``).

        Raises:
            OSError: no such directory, no space (the memory is reserved up front with
                ``posix_fallocate``, so a full tmpfs fails here, not with SIGBUS later).
        """
        push_size = pull_size = align_up(max(push_size_bytes, pull_size_bytes, ALIGN_BYTES))
        size = HEADER_BYTES + push_size
        nonce = secrets.token_bytes(NONCE_BYTES)
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd, buffer = _create_file(directory / name, size, lock=False)
        os.close(fd)
        buffer[: len(MAGIC)] = MAGIC
        buffer[len(MAGIC) : len(MAGIC) + NONCE_BYTES] = nonce
        return cls(directory, name, nonce, buffer, push_size, pull_size)

    def offer(self) -> pb.ShmOffer:
        """The offer message naming this segment."""
        return pb.ShmOffer(
            name=self.name,
            nonce=self.nonce,
            size_bytes=self.size_bytes,
            push_offset_bytes=self.push.offset_bytes,
            push_size_bytes=self.push.size_bytes,
            pull_offset_bytes=self.pull.offset_bytes,
            pull_size_bytes=self.pull.size_bytes,
        )

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); a file already gone is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / self.name)

    def close(self) -> None:
        """Unlink (if still there) and unmap."""
        self.unlink()
        self.layouts.clear()
        buffer, self._buffer = self._buffer, None
        _close_mapping(buffer)


class ServerMapping:
    """A client's segment as mapped by the server (:meth:`attach`).

    Attributes:
        push: The client's push region (gradients are read from it).
        pull: The client's pull region (pulled values are written into it).
    """

    def __init__(self, buffer: mmap.mmap, offer: pb.ShmOffer) -> None:
        self._buffer: mmap.mmap | None = buffer
        self.name = offer.name
        self.push = Region(buffer, offer.push_offset_bytes, offer.push_size_bytes, "push")
        self.pull = Region(buffer, offer.pull_offset_bytes, offer.pull_size_bytes, "pull")
        #: As :attr:`ClientSegment.layouts`.
        self.layouts: dict[str, object] = {}

    @classmethod
    def attach(cls, offer: pb.ShmOffer, directory: Path = SHM_DIR) -> ServerMapping:
        """Map an offered segment, check its nonce, and unlink its file.

        Raises:
            ShmDeclined: a bad name or layout, no such file (another host or container), a
                different size, or a nonce mismatch; the reason says which.
        """
        if not _NAME_RE.match(offer.name):
            raise ShmDeclined(f"segment name {offer.name!r} is not paramserver-<pid>-<hex16>")
        if len(offer.nonce) != NONCE_BYTES:
            raise ShmDeclined(f"nonce must be {NONCE_BYTES} bytes, got {len(offer.nonce)}")
        size = offer.size_bytes
        _check_layout(
            size,
            offer.push_offset_bytes,
            offer.push_size_bytes,
            offer.pull_offset_bytes,
            offer.pull_size_bytes,
        )
        path = directory / offer.name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as err:
            raise ShmDeclined(f"cannot open {path} ({err.strerror}): not on this host?") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise ShmDeclined(f"{path} is not a regular file of {size} bytes")
            buffer = mmap.mmap(fd, size)
        except OSError as err:
            raise ShmDeclined(f"cannot map {path}: {err}") from None
        finally:
            os.close(fd)
        header = bytes(buffer[: len(MAGIC) + NONCE_BYTES])
        if header[: len(MAGIC)] != MAGIC or not hmac.compare_digest(
            header[len(MAGIC) :], offer.nonce
        ):
            buffer.close()
            raise ShmDeclined(f"{path}: nonce mismatch (a different /dev/shm: another host?)")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return cls(buffer, offer)

    def close(self) -> None:
        """Unmap (deferred until the last view is gone)."""
        self.layouts.clear()
        buffer, self._buffer = self._buffer, None
        _close_mapping(buffer)


class MappedSegment:
    """A named segment mapped whole by a same-host peer (:meth:`attach`); never unlinked here.

    Attributes:
        name: File name in the segment directory.
        size_bytes: Segment size.
        buf: A writable view of the whole mapping.
    """

    def __init__(self, name: str, buffer: mmap.mmap) -> None:
        self.name = name
        self.size_bytes = len(buffer)
        self._buffer: mmap.mmap | None = buffer
        self.buf: memoryview = memoryview(buffer)

    @classmethod
    def attach(cls, name: str, min_size_bytes: int, directory: Path = SHM_DIR) -> MappedSegment:
        """Map the existing segment ``name`` of at least ``min_size_bytes`` bytes.

        Raises:
            ValueError: ``name`` is not an owned segment's name (``paramserver-<kind>-<pid>-
                <hex16>``), the file is not a regular file, or it is smaller than
                ``min_size_bytes``.
            FileNotFoundError: no such segment (its owner is on another host, or gone).
            OSError: it cannot be opened or mapped.
        """
        m = _ANY_NAME_RE.match(name)
        if m is None or m.group(1) is None:
            raise ValueError(f"{name!r} is not a segment name paramserver-<kind>-<pid>-<hex16>")
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < max(1, min_size_bytes):
                raise ValueError(
                    f"segment {name} has {st.st_size} < {min_size_bytes} bytes (or is not a "
                    "regular file)"
                )
            buffer = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, buffer)

    def close(self) -> None:
        """Unmap (deferred until the last exported view is gone; idempotent)."""
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        with contextlib.suppress(BufferError):  # an array over buf still lives
            self.buf.release()
        _close_mapping(buffer)


class OwnedSegment(MappedSegment):
    """A long-lived segment kept by its creating process for same-host peers (:meth:`create`).

    The owner holds a shared ``flock`` on the file for as long as it lives, which tells
    :func:`sweep_dead` that the segment is in use even where the owner's pid is not visible.
    :meth:`close` unlinks the file; an owner killed before it closed leaves the file to the
    next :func:`sweep_dead` (see the module docstring).
    """

    def __init__(self, directory: Path, name: str, fd: int, buffer: mmap.mmap) -> None:
        super().__init__(name, buffer)
        self.directory = directory
        self._fd = fd

    @classmethod
    def create(cls, size_bytes: int, kind: str, directory: Path = SHM_DIR) -> OwnedSegment:
        """Create, size (zero-filled) and map ``paramserver-<kind>-<pid>-<hex16>``.

        Args:
            size_bytes: Segment size (at least 1).
            kind: Lower-case word naming the owner's use (``g2``).
            directory: Where the file goes (``/dev/shm``).

        Raises:
            ValueError: ``kind`` is not a lower-case word.
            OSError: no such directory, or no space (reserved up front, never SIGBUS later).
        """
        if not _KIND_RE.match(kind):
            raise ValueError(f"segment kind {kind!r} must be a lower-case word")
        name = f"{NAME_PREFIX}{kind}-{os.getpid()}-{secrets.token_hex(8)}"
        fd, buffer = _create_file(directory / name, max(1, size_bytes), lock=True)
        return cls(directory, name, fd, buffer)

    def close(self) -> None:
        """Unlink the file, unmap, and drop the owner's lock (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / self.name)
        super().close()
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _locked(path: Path) -> bool:
    """True when some process holds a lock on ``path`` (a live :class:`OwnedSegment` owner)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return True  # gone already, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock
    return False


def sweep_dead(directory: Path = SHM_DIR) -> list[str]:
    """Remove segment files whose creating process is dead: a client killed between create and
    offer, an :class:`OwnedSegment` owner killed before it closed (its lock is free).

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _ANY_NAME_RE.match(name)
        if m is None:
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or _pid_alive(pid) or _locked(directory / name):
            continue
        try:
            os.unlink(directory / name)
        except OSError:
            continue
        removed.append(name)
    if removed:
        logger.debug("removed %d shared-memory segment(s) of dead processes", len(removed))
    return removed


def available(directory: Path = SHM_DIR) -> bool:
    """True when ``directory`` exists and is writable (Linux ``/dev/shm``)."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)
