"""The on-storage format of one page shard: a header, then the payload.

``MAGIC | header length (4 bytes, little-endian) | header (msgpack) | payload``.
The header holds the format version, the payload's length and CRC-32 checksum,
and the provenance (model id, layout, dtype, shard shape, page size). A page
whose header, length, checksum or provenance does not match is a miss — never
an error, never bytes handed to a rank — and ``decode_page`` says why.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import asdict, dataclass

import msgpack

MAGIC = b"KVFABRIC"
FORMAT_VERSION = 1
_MAX_HEADER = 4096
_KEY = re.compile(r"^[0-9a-f]{64}\.[0-9]{1,4}-[0-9]{1,4}-[0-9]{1,4}$")


@dataclass(frozen=True)
class Provenance:
    """What a page was computed for; a page is only served to the same."""

    model_id: str
    layout: str
    dtype: str
    shard_shape: tuple[int, ...]
    page_size: int

    def as_wire(self) -> dict:
        """The header form (computed once: it is compared on every read)."""
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = asdict(self)
            wire["shard_shape"] = list(self.shard_shape)
            object.__setattr__(self, "_wire", wire)
        return wire


def page_key(page_hash: bytes, suffix: str) -> str:
    """The storage key of one shard of one page: hex hash + ``.pp-cp-tp``."""
    return f"{page_hash.hex()}.{suffix}"


def check_key(key: str) -> str:
    """Keys become file names: only hex digests with a numeric shard suffix pass."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"storage key {key!r} is not a page key")
    return key


def checksum(payload: bytes | memoryview) -> int:
    # CRC-32 catches torn, truncated and bit-flipped pages at memory speed; who
    # may read a page is settled by its key (a hash of namespace and prefix).
    return zlib.crc32(payload)


def encode_header(payload: bytes | memoryview, provenance: Provenance) -> bytes:
    """Everything stored before ``payload``: ``encode_header(p) + p`` is the page."""
    header = msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "len": len(payload),
            "sum": checksum(payload),
            "prov": provenance.as_wire(),
        },
        use_bin_type=True,
    )
    return MAGIC + len(header).to_bytes(4, "little") + header


def encode_page(payload: bytes | memoryview, provenance: Provenance) -> bytes:
    return encode_header(payload, provenance) + bytes(payload)


PREAMBLE = len(MAGIC) + 4


def header_length(preamble: bytes | memoryview) -> int | str:
    """The header's length from the first ``PREAMBLE`` bytes, or ``format``."""
    if len(preamble) < PREAMBLE or preamble[: len(MAGIC)] != MAGIC:
        return "format"
    n = int.from_bytes(preamble[len(MAGIC) : PREAMBLE], "little")
    return n if n <= _MAX_HEADER else "format"


def check_header(raw: bytes | memoryview, provenance: Provenance, payload_len: int) -> dict | str:
    """The parsed header if it is this format, this provenance and this length."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:
        return "format"
    if not isinstance(header, dict) or header.get("v") != FORMAT_VERSION:
        return "format"
    if header.get("prov") != provenance.as_wire():
        return "provenance"
    if header.get("len") != payload_len:
        return "truncated"
    return header


def decode_page(blob: bytes, provenance: Provenance, payload_len: int) -> memoryview | str:
    """The payload, or the reason it is refused: ``format``, ``truncated``,
    ``checksum`` or ``provenance``."""
    view = memoryview(blob)
    n = header_length(view)
    if isinstance(n, str):
        return n
    if len(view) < PREAMBLE + n:
        return "truncated"
    header = check_header(view[PREAMBLE : PREAMBLE + n], provenance, payload_len)
    if isinstance(header, str):
        return header
    payload = view[PREAMBLE + n :]
    if len(payload) != payload_len:
        return "truncated"
    if header.get("sum") != checksum(payload):
        return "checksum"
    return payload
