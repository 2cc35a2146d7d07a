"""The on-storage format of one page shard: a header, then the payload.

``MAGIC | header length (4 bytes, little-endian) | header (msgpack) | payload``.
The header holds the format version, the page's own full key (chain hash,
model tag, shard), the payload's length and CRC-32 checksum, and the
provenance (model id, layout, dtype, shard shape, page size). A page whose
header, key, length, checksum or provenance does not match what it was read
for is a miss — never an error, never bytes handed to a rank — and
``decode_page`` says why. So a valid page copied, swapped or linked under
another key (another page, shard, tenant or model) is never served.

Keys are ``<chain hash hex>.<model tag>.<pp>-<cp>-<tp>``: the model tag (a
digest of the provenance) keeps models and shapes apart in one shared L3.
"""

from __future__ import annotations

import hashlib
import re
import threading
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np

try:  # zlib-ng's CRC-32 (folded with carry-less multiplies) is zlib's, ~5x faster
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # a platform without its wheel: the same checksum, slower
    _crc32 = zlib.crc32

MAGIC = b"KVFABRIC"
FORMAT_VERSION = 2
_MAX_HEADER = 4096
_KEY = re.compile(r"[0-9a-f]{64}\.[0-9a-f]{16}\.[0-9]{1,4}-[0-9]{1,4}-[0-9]{1,4}")


@dataclass(frozen=True)
class Provenance:
    """What a page was computed for; a page is only served to the same."""

    model_id: str
    layout: str
    dtype: str
    shard_shape: tuple[int, ...]
    page_size: int
    # A hybrid model's other components (``sliding`` KV pages, ``mamba`` states)
    # are pages of their own provenance; ``full`` pages keep the form they had
    # before components existed, so their keys did not change.
    component: str = "full"

    def as_wire(self) -> dict:
        """The header form (computed once: it is compared on every read)."""
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = asdict(self)
            wire["shard_shape"] = list(self.shard_shape)
            if self.component == "full":
                del wire["component"]
            object.__setattr__(self, "_wire", wire)
        return wire

    @property
    def tag(self) -> str:
        """16 hex digits naming this provenance in page keys (models share no key)."""
        tag = self.__dict__.get("_tag")
        if tag is None:
            wire = msgpack.packb(self.as_wire(), use_bin_type=True)
            tag = hashlib.sha256(b"kvfabric/model\0" + wire).hexdigest()[:16]
            object.__setattr__(self, "_tag", tag)
        return tag


def page_key(page_hash: bytes, model_tag: str, suffix: str) -> str:
    """The storage key of one shard of one page: chain hash, model tag, ``pp-cp-tp``."""
    return f"{page_hash.hex()}.{model_tag}.{suffix}"


def check_key(key: str) -> str:
    """Keys become file names: only ``page_key`` forms pass (no newline, nothing else)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"storage key {key!r} is not a page key")
    return key


def checksum(payload: bytes | memoryview, value: int = 0) -> int:
    """CRC-32 of ``payload`` (continuing ``value``: the CRC of what came before)."""
    # CRC-32 catches torn, truncated and bit-flipped pages at memory speed; who
    # may read a page is settled by its key (a hash of namespace and prefix).
    return _crc32(payload, value)


def encode_header(
    payload: bytes | memoryview, provenance: Provenance, key: str, auth: Any = None
) -> bytes:
    """Everything stored before ``payload`` under ``key``: ``encode_header(p) + p`` is
    the page. With ``auth`` (``fabric.l3.auth.PageAuth``), the header also
    carries the page's tag (``nonce``, ``mac``)."""
    fields = {
        "v": FORMAT_VERSION,
        "key": key,
        "len": len(payload),
        "sum": checksum(payload),
        "prov": provenance.as_wire(),
    }
    if auth is not None:
        fields.update(auth.sign(payload, provenance, key))
    header = msgpack.packb(fields, use_bin_type=True)
    return MAGIC + len(header).to_bytes(4, "little") + header


def encode_page(payload: bytes | memoryview, provenance: Provenance, key: str) -> bytes:
    return encode_header(payload, provenance, key) + bytes(payload)


PREAMBLE = len(MAGIC) + 4


def header_length(preamble: bytes | memoryview) -> int | str:
    """The header's length from the first ``PREAMBLE`` bytes, or ``format``."""
    if len(preamble) < PREAMBLE or preamble[: len(MAGIC)] != MAGIC:
        return "format"
    n = int.from_bytes(preamble[len(MAGIC) : PREAMBLE], "little")
    return n if n <= _MAX_HEADER else "format"


def check_header(
    raw: bytes | memoryview, provenance: Provenance, payload_len: int, key: str
) -> dict | str:
    """The parsed header if it is this format, this provenance, this page's key and
    this length; else why not: ``format``, ``provenance``, ``key`` or ``truncated``."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:
        return "format"
    if not isinstance(header, dict) or header.get("v") != FORMAT_VERSION:
        return "format"
    if header.get("prov") != provenance.as_wire():
        return "provenance"
    if header.get("key") != key:
        return "key"
    if header.get("len") != payload_len:
        return "truncated"
    return header


def decode_page(
    blob: bytes, provenance: Provenance, payload_len: int, key: str, auth: Any = None
) -> memoryview | str:
    """The payload, or the reason it is refused: ``format``, ``truncated``,
    ``checksum``, ``provenance``, ``key`` or (with ``auth``) ``auth``."""
    view = memoryview(blob)
    n = header_length(view)
    if isinstance(n, str):
        return n
    if len(view) < PREAMBLE + n:
        return "truncated"
    header = check_header(view[PREAMBLE : PREAMBLE + n], provenance, payload_len, key)
    if isinstance(header, str):
        return header
    payload = view[PREAMBLE + n :]
    if len(payload) != payload_len:
        return "truncated"
    refused = check_payload(header, payload, provenance, key, auth)
    return payload if refused is None else refused


def check_payload(
    header: dict, payload: Any, provenance: Provenance, key: str, auth: Any = None
) -> str | None:
    """``None`` when ``payload`` is the page ``header`` describes, else why not:
    ``checksum`` or (with ``auth``) ``auth``. With ``auth`` the tag already checks
    every payload byte, so the checksum is computed only to name a refusal (a
    corrupt page, not a forged one)."""
    if auth is None:
        return None if header.get("sum") == checksum(payload) else "checksum"
    if auth.verify(header, key, provenance, payload):
        return None
    return "checksum" if header.get("sum") != checksum(payload) else "auth"


def check_read(
    head: bytes | bytearray | memoryview,
    payload: Any,
    got: int,
    provenance: Provenance,
    key: str,
    auth: Any = None,
    stored_len: int | None = None,
) -> str | None:
    """The one check of a page read from L3, whoever read it — the storage actor
    (``L3Backend.get``) or a rank itself (``fabric.l3.direct``): ``None`` when
    it is the page, else why not, as ``L3Backend.refuse`` counts it.

    ``head``: the record's preamble and header; ``payload``: what was read into
    the caller's row (a page long); ``got``: the bytes read for the record — fewer
    than ``head`` and ``payload`` (``truncated``: the file was cut), or more (a
    page file longer than its record: ``truncated`` too); ``stored_len``: the
    payload length the store's index gives, when it has one: a record of another
    length is refused by what its header says (``check_header``)."""
    length = len(memoryview(payload).cast("B"))
    if stored_len is not None and stored_len != length:
        n = header_length(head)
        if isinstance(n, str):
            return "format"
        if PREAMBLE + n != len(head):
            return "truncated"
        header = check_header(memoryview(head)[PREAMBLE:], provenance, length, key)
        return header if isinstance(header, str) else "truncated"
    if got != len(head) + length:
        return "truncated"
    if fast_check(provenance, length, auth)(head, payload, key):
        return None
    return check_record(head, payload, provenance, key, auth)


def check_record(
    head: bytes | bytearray | memoryview,
    payload: Any,
    provenance: Provenance,
    key: str,
    auth: Any = None,
) -> str | None:
    """``None`` when ``head`` (preamble and header, read whole) and ``payload``
    are the page stored under ``key`` for ``provenance``, else why not: what
    ``header_length``, ``check_header`` and ``check_payload`` say."""
    n = header_length(head)
    if isinstance(n, str) or PREAMBLE + n != len(head):
        return "format"
    header = check_header(
        memoryview(head)[PREAMBLE:], provenance, len(memoryview(payload).cast("B")), key
    )
    if isinstance(header, str):
        return header
    return check_payload(header, payload, provenance, key, auth)


class FastCheck:
    """``check_record``'s answer for the common page at a few byte compares:
    a page whose header is byte for byte what ``encode_header`` writes for this
    key, length, provenance and payload (the payload's checksum, or with
    ``auth`` a valid tag) passes; anything else — another encoder's field
    order, a damaged or foreign page — is left to ``check_read``, which names
    the refusal. Accepting here implies ``check_record`` accepts (the header
    decodes to exactly the fields it compares), so nothing is weaker; what is
    saved is decoding and comparing each header in Python."""

    def __init__(self, provenance: Provenance, payload_len: int, auth: Any = None) -> None:
        pack = _packer()
        self.provenance = provenance
        self.auth = auth
        # With ``auth``: the nonce's length (which names the MAC, ``PageAuth``),
        # its field, and the bytes from that field to the header's end.
        self._nonce_len = auth.nonce_bytes(payload_len) if auth is not None else 0
        self._nonce = _NONCE + bytes([self._nonce_len])
        self._auth_tail = len(self._nonce) + self._nonce_len + len(_MAC) + 16
        fields = 7 if auth is not None else 5
        self._map = bytes([0x80 | fields]) + pack("v") + pack(FORMAT_VERSION) + pack("key")
        self._len = pack("len") + pack(payload_len) + pack("sum")
        self._prov = pack("prov") + pack(provenance.as_wire())
        self._bound = b"\0" + provenance.tag.encode("ascii")  # after the key (PageAuth.bound)
        self._templates: dict[tuple[int, int], tuple | None] = {}
        self._parts: dict[tuple[int, int], tuple] = {}  # (``_auth_parts``)
        if auth is not None:  # the nonce's and tag's lengths are the header's form's
            self._tag_ok = auth.checker(self._nonce_len)

    def __call__(self, head: Any, payload: Any, key: str) -> bool:
        """Whether ``head`` (preamble and header) and ``payload`` are the page
        stored under ``key``, decided without decoding; ``False``: ask ``check_read``."""
        pack = _packer()
        before = self._map + pack(key) + self._len
        if self.auth is None:
            body = before + pack(checksum(payload)) + self._prov
            return head == MAGIC + len(body).to_bytes(4, "little") + body
        h = head if isinstance(head, bytes) else bytes(head)
        return self._authed(h, 0, len(h), key, payload)

    def _authed(self, heads: bytes, at: int, head_len: int, key: str, payload: Any) -> bool:
        """``__call__`` with ``auth`` for the header of ``head_len`` bytes at
        ``at`` in ``heads`` (one header, or a run's one after another): its
        fixed parts compared as slices, then its tag."""
        raw_key = key.encode("ascii")
        parts = self._parts.get((len(raw_key), head_len))
        if parts is None:
            parts = self._auth_parts(len(raw_key), head_len)
        if not parts:  # not the form this key's header takes: ``check_read`` decides
            return False
        before, key_at, after_key, sum_end, after_sum, nonce_at, after_nonce, mac_at = parts
        nonce_end = at + nonce_at + self._nonce_len
        if not (
            heads.startswith(before, at)
            and heads.startswith(raw_key, at + key_at)
            and heads.startswith(after_key, at + key_at + len(raw_key))
            and heads.startswith(after_sum, at + sum_end)
            and heads.startswith(after_nonce, nonce_end)
        ):
            return False
        nonce, mac = heads[at + nonce_at : nonce_end], heads[at + mac_at : at + head_len]
        return self._tag_ok(nonce, mac, raw_key + self._bound, payload)

    def _nonce_at(self, head_len: int) -> int:
        """Where the nonce's bytes begin in an authenticated header of ``head_len``."""
        return head_len - self._auth_tail + len(self._nonce)

    def _auth_parts(self, key_len: int, head_len: int) -> tuple:
        """Where an authenticated header of a key of ``key_len`` characters that
        is ``head_len`` bytes long holds what: the bytes before its key, the
        key's offset, the bytes from the key to the checksum's value (a 4-byte
        integer, not compared: the tag covers the payload), where that ends, the
        bytes from there to the nonce, the nonce's offset, the bytes from the
        nonce to the tag, the tag's offset; ``()`` for any other form."""
        template = self._template(key_len, head_len)
        parts: tuple = ()
        if template is not None:
            row, key_at, sum_at, _ = template
            head = row.tobytes()
            nonce_at = self._nonce_at(head_len)
            after_nonce = nonce_at + self._nonce_len
            parts = (
                head[:key_at], key_at, head[key_at + key_len : sum_at], sum_at + 4,
                head[sum_at + 4 : nonce_at], nonce_at, head[after_nonce : head_len - 16],
                head_len - 16,
            )  # fmt: skip
        if len(self._parts) > 16:
            self._parts.clear()
        self._parts[key_len, head_len] = parts
        return parts

    def run(self, heads: np.ndarray, payloads: np.ndarray, keys: Sequence[str]) -> int:
        """How many leading pages of a run pass, decided for the run at once:
        ``heads`` one header a row (all of one length), ``payloads`` one page a
        row. The headers are compared with what ``encode_header`` writes as one
        array — the keys, the checksums and every other byte in columns — and
        only where that finds a difference (or the run is not the common form)
        does the page-by-page check (``__call__``) take over from there."""
        n = len(keys)
        if not n:
            return 0
        template = self._template(len(keys[0]), heads.shape[1])
        if template is None or len(set(map(len, keys))) != 1:
            return self.one_by_one(heads, payloads, keys, 0)
        row, key_at, sum_at, fixed = template
        expected = np.empty_like(heads)
        expected[:] = row
        expected[:, key_at : key_at + len(keys[0])] = np.frombuffer(
            "".join(keys).encode("ascii"), dtype=np.uint8
        ).reshape(n, -1)
        if self.auth is None:
            sums = np.array(list(map(checksum, payloads)), dtype=np.uint64)
            if int(sums.min()) < 1 << 16:  # a short encoding: not this template's
                return self.one_by_one(heads, payloads, keys, 0)
            expected[:, sum_at : sum_at + 4] = sums.astype(">u4").view(np.uint8).reshape(n, 4)
            same = (heads == expected).all(axis=1)
        else:
            same = (heads[:, fixed] == expected[:, fixed]).all(axis=1)
        passed = n if bool(same.all()) else int(np.argmin(same))
        if self.auth is not None:
            tail = self._nonce_at(heads.shape[1])
            for i in range(passed):
                nonce = heads[i, tail : tail + self._nonce_len].tobytes()
                mac = heads[i, -16:].tobytes()
                bound = keys[i].encode("ascii") + self._bound
                if not self._tag_ok(nonce, mac, bound, payloads[i]):
                    return i + self.one_by_one(heads, payloads, keys, i)
        return passed + self.one_by_one(heads, payloads, keys, passed) if passed < n else n

    def one_by_one(
        self, heads: np.ndarray, payloads: np.ndarray, keys: Sequence[str], i: int = 0
    ) -> int:
        """From page ``i`` on, how many more pass ``__call__`` one at a time
        (``heads``: a header a row)."""
        start = i
        if self.auth is not None:  # the run's headers as one bytes object
            whole, width = heads[i:].tobytes(), heads.shape[1]
            while i < len(keys) and self._authed(
                whole, (i - start) * width, width, keys[i], payloads[i]
            ):
                i += 1
            return i - start
        while i < len(keys) and self(heads[i].tobytes(), payloads[i], keys[i]):
            i += 1
        return i - start

    def _template(self, key_len: int, head_len: int) -> tuple | None:
        """For headers of keys of ``key_len`` characters that are ``head_len``
        bytes long: one header's bytes, where its key and checksum lie, and the
        columns every header of the run shares (with ``auth``: all but the
        checksum, nonce and tag); ``None`` for any other length."""
        made = self._templates.get((key_len, head_len))
        if made is None and (key_len, head_len) not in self._templates:
            pack = _packer()
            key = "k" * key_len
            before = self._map + pack(key) + self._len
            body = before + pack(0xFFFFFFFF) + self._prov  # a 4-byte checksum (0xce)
            if self.auth is not None:
                body += (
                    pack("nonce") + pack(b"\0" * self._nonce_len) + pack("mac") + pack(b"\0" * 16)
                )
            head = MAGIC + len(body).to_bytes(4, "little") + body
            if len(head) == head_len:
                key_at = PREAMBLE + len(before) - len(self._len) - key_len
                sum_at = PREAMBLE + len(before) + 1
                fixed = np.ones(head_len, dtype=bool)  # (with auth: all but these)
                if self.auth is not None:
                    nonce_at = self._nonce_at(head_len)
                    fixed[sum_at : sum_at + 4] = False
                    fixed[nonce_at : nonce_at + self._nonce_len] = False
                    fixed[head_len - 16 :] = False  # the tag
                made = (np.frombuffer(head, dtype=np.uint8), key_at, sum_at, fixed)
            if len(self._templates) > 16:
                self._templates.clear()
            self._templates[key_len, head_len] = made
        return made


_NONCE = b"\xa5nonce\xc4"  # the header's "nonce" (then its length: 12, 16 or 32 bytes)
_MAC = b"\xa3mac\xc4\x10"  # its "mac": 16 bytes


def fast_check(provenance: Provenance, payload_len: int, auth: Any = None) -> FastCheck:
    """The ``FastCheck`` of pages of ``provenance`` and length (made once)."""
    key = (provenance, payload_len, auth)
    check = _FAST.get(key)
    if check is None:
        if len(_FAST) >= 64:
            _FAST.clear()
        check = _FAST[key] = FastCheck(provenance, payload_len, auth)
    return check


_FAST: dict[tuple, FastCheck] = {}


def _packer() -> Any:
    """This thread's msgpack packer (a packer is not shared between threads)."""
    pack = getattr(_PACKERS, "pack", None)
    if pack is None:
        pack = _PACKERS.pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
    return pack


_PACKERS = threading.local()
