"""Limits of the wire contract that both sides check, and how long names appear in messages.

Every limit here is also stated in the .proto comments (``protos/paramserver/api/v1``):

- a key is 1 to :data:`MAX_KEY_BYTES` bytes of UTF-8, and so is a table name
  (:data:`MAX_TABLE_NAME_BYTES`);
- a table's rows are 1 to :data:`MAX_TABLE_DIM` values wide;
- a worker name is 1 to :data:`MAX_WORKER_NAME_BYTES` bytes of UTF-8 (a worker id, which the
  server makes as ``"{name}#{registration}"``, at most :data:`MAX_WORKER_ID_BYTES`);
- an error's details are cut to :data:`MAX_ERROR_DETAILS_BYTES`, far below gRPC's 16 KiB limit
  on trailing metadata (details over it reach the client as RESOURCE_EXHAUSTED instead of the
  real code).

Names longer than :data:`SHOWN_NAME_CHARS` characters are shortened in error messages and log
lines (:func:`shown`), so a bad request cannot make every log line huge.
"""

from __future__ import annotations

from typing import Final

from paramserver.errors import InvalidArgument

#: Longest key, in bytes of UTF-8 (TensorFlow variable paths stay far below it).
MAX_KEY_BYTES: Final = 1024
#: Longest table name, in bytes of UTF-8 (as keys).
MAX_TABLE_NAME_BYTES: Final = 1024
#: Widest table row, in values (TorchRec and DLRM dimensions stay far below it; a row of it in
#: float32 with adam's two moments is 768 KiB).
MAX_TABLE_DIM: Final = 65536
#: Longest worker name, in bytes of UTF-8.
MAX_WORKER_NAME_BYTES: Final = 256
#: Longest worker id: a name, ``#`` and a decimal registration number.
MAX_WORKER_ID_BYTES: Final = MAX_WORKER_NAME_BYTES + 21
#: Longest error details a server sends, in bytes of UTF-8.
MAX_ERROR_DETAILS_BYTES: Final = 4096
#: Names longer than this many characters are shortened in messages and logs.
SHOWN_NAME_CHARS: Final = 80


def shown(name: str, limit: int = SHOWN_NAME_CHARS) -> str:
    """``name`` as it appears in a message or log line: at most ``limit`` characters, a long
    one cut in the middle with its length noted (``"abc…(1048576 chars)…xyz"``)."""
    if len(name) <= limit:
        return name
    half = max(1, (limit - 20) // 2)
    return f"{name[:half]}…({len(name)} chars)…{name[-half:]}"


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_length(what: str, text: str, limit: int, empty: str) -> None:
    if not text:
        raise InvalidArgument(empty)
    if len(text) * 4 > limit and _utf8_len(text) > limit:  # (short text: no encoding)
        raise InvalidArgument(
            f"{what} {shown(text)!r} is {_utf8_len(text)} bytes of UTF-8; "
            f"the limit is {limit} bytes"
        )


def check_key(key: str) -> None:
    """Refuse an empty key or one over :data:`MAX_KEY_BYTES`.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) naming the (shortened) key and the limit.
    """
    _check_length("key", key, MAX_KEY_BYTES, "key must be a non-empty string")


def check_table_name(name: str) -> None:
    """Refuse an empty table name or one over :data:`MAX_TABLE_NAME_BYTES`.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) naming the (shortened) name and the limit.
    """
    _check_length("table name", name, MAX_TABLE_NAME_BYTES, "a table needs a non-empty name")


def check_worker_name(name: str) -> None:
    """Refuse an empty worker name or one over :data:`MAX_WORKER_NAME_BYTES`.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) naming the (shortened) name and the limit.
    """
    _check_length("worker name", name, MAX_WORKER_NAME_BYTES, "worker_name must be non-empty")


def check_worker_id(worker_id: str) -> None:
    """Refuse an empty worker id (the id Register returned) or one over
    :data:`MAX_WORKER_ID_BYTES` (no id the server makes is longer).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT).
    """
    _check_length(
        "worker_id",
        worker_id,
        MAX_WORKER_ID_BYTES,
        "worker_id must be non-empty: send the id Register returned",
    )


def cut_details(details: str) -> str:
    """Error details cut to at most :data:`MAX_ERROR_DETAILS_BYTES` bytes of UTF-8."""
    if len(details) * 4 <= MAX_ERROR_DETAILS_BYTES:
        return details
    raw = details.encode("utf-8", "replace")
    if len(raw) <= MAX_ERROR_DETAILS_BYTES:
        return details
    return raw[: MAX_ERROR_DETAILS_BYTES - 16].decode("utf-8", "ignore") + "… (cut)"
