"""Cache keys: a namespace plus page-aligned token ids, and their chained page hashes.

Tokens are packed once per request into little-endian uint32 bytes, so the
tree compares keys with ``bytes.startswith`` (one C call per node) and never
loops over tokens in Python. Page hashes are the SHA-256 chain
``h_i = H(h_{i-1} || page_i)`` seeded by the namespace: equal hashes mean equal
namespace and equal whole prefix, which makes them content addresses for L3.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence

from fabric.errors import InvalidInput

TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1
MAX_NAMESPACE_CHARS = 256
DEFAULT_NAMESPACE = "default"

_TOKEN_TYPECODE = next(c for c in "IL" if array(c).itemsize == TOKEN_BYTES)
_SWAP = sys.byteorder != "little"


# Namespaces whose chains are SGLang's own (``get_storage_hash_str``), so pages an
# SGLang worker stores through ``fabric.engines.sglang`` and pages this fabric
# stores have equal keys: ``sglang`` is SGLang's unseeded chain (a request with no
# extra key or cache salt), ``sglang:<extra key>`` its chain seeded by that extra key.
SGLANG_NAMESPACE = "sglang"
_SGLANG_SEED_DOMAIN = b"sglang-cache-namespace-v1"
# What every seed of a seeded chain hashes (kvfabric's own, and every digest this
# project domain-separates) starts with one of these. An unseeded chain's first
# page is hashed alone, so a first page spelling one out would hash to a seed and
# continue as another namespace's chain: such prompts are refused there.
_SEED_PREFIXES = (b"kvfabric/", _SGLANG_SEED_DOMAIN)


def sglang_seed(extra_key: str | None) -> bytes:
    """SGLang's storage-chain seed for a request's extra key (its
    ``storage_namespace_seed(extra_key, None)``); ``b""`` for none (unseeded)."""
    if extra_key is None:
        return b""
    encoded = extra_key.encode()
    digest = hashlib.sha256(_SGLANG_SEED_DOMAIN)
    digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    digest.update(b"\x00")  # no cache salt
    return digest.digest()


def namespace_seed(namespace: str) -> bytes:
    """The hash that seeds the page-hash chain of every key in ``namespace``:
    SGLang's seed for ``sglang`` and ``sglang:<extra key>``, else kvfabric's own."""
    if namespace == SGLANG_NAMESPACE:
        return b""
    if namespace.startswith(SGLANG_NAMESPACE + ":"):
        return sglang_seed(namespace[len(SGLANG_NAMESPACE) + 1 :])
    return hashlib.sha256(b"kvfabric/ns\0" + namespace.encode()).digest()


def check_unseeded(namespace: str, data: bytes) -> None:
    """``InvalidInput`` when ``data`` (packed tokens) opens an unseeded chain with a
    page that spells out a seed's preimage: its chain would continue as the chain
    of another namespace (another tenant's keys)."""
    if namespace == SGLANG_NAMESPACE and data.startswith(_SEED_PREFIXES):
        raise InvalidInput(
            f"tokens are refused in namespace {namespace!r}: its chain is unseeded, and a "
            "first page that spells out a namespace seed's preimage would continue as "
            "another namespace's chain"
        )


def check_namespace(namespace: object) -> str:
    """``namespace`` if it is a non-empty str of at most ``MAX_NAMESPACE_CHARS`` that
    encodes as UTF-8 (it seeds hashes and travels in messages); else ``InvalidInput``."""
    ok = isinstance(namespace, str) and 0 < len(namespace) <= MAX_NAMESPACE_CHARS
    if ok:
        try:
            namespace.encode("utf-8")  # type: ignore[union-attr]
        except UnicodeEncodeError:
            ok = False
    if not ok:
        raise InvalidInput(
            f"namespace {namespace!r} is refused: allowed is a non-empty str of at most "
            f"{MAX_NAMESPACE_CHARS} characters that encodes as UTF-8"
        )
    return namespace  # type: ignore[return-value]


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ``InvalidInput`` naming the first bad
    token (bools are refused although Python counts them as ints)."""
    try:
        items = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
    except TypeError:
        raise InvalidInput(
            f"tokens must be a sequence of ints, got {type(tokens).__name__}"
        ) from None
    try:
        if bool in set(map(type, items)):
            raise TypeError("bool token")
        packed = array(_TOKEN_TYPECODE, items)
    except (TypeError, OverflowError, ValueError):
        raise _bad_token(items) from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _bad_token(tokens: Iterable[int]) -> InvalidInput:
    try:
        items = list(tokens)
    except TypeError:
        return InvalidInput(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    for i, t in enumerate(items):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
            return InvalidInput(
                f"token {t!r} at position {i} is refused: allowed is an int in [0, {MAX_TOKEN_ID}]"
            )
    return InvalidInput("tokens are refused: allowed is a sequence of ints")


def unpack_tokens(data: bytes) -> list[int]:
    packed = array(_TOKEN_TYPECODE)
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def check_vocab(data: bytes, vocab_size: int) -> None:
    """``InvalidInput`` naming the first token of packed ``data`` outside a model's
    vocabulary ``[0, vocab_size)``."""
    packed = array(_TOKEN_TYPECODE)
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    if packed and max(packed) >= vocab_size:
        at = next(i for i, t in enumerate(packed) if t >= vocab_size)
        raise InvalidInput(
            f"token {packed[at]} at position {at} is refused: the model's vocabulary is "
            f"[0, {vocab_size}) (model.vocab_size)"
        )


def chain_hashes(prev: bytes, data: bytes, page_bytes: int) -> list[bytes]:
    """Continue a page-hash chain from ``prev`` over the pages packed in ``data``."""
    sha256 = hashlib.sha256  # one comprehension: the hot loop of the whole core
    return [
        prev := sha256(prev + data[start : start + page_bytes]).digest()
        for start in range(0, len(data), page_bytes)
    ]


def answers_chain(prev: bytes, data: bytes, page_bytes: int, hashes: Sequence[bytes]) -> bool:
    """Whether ``hashes``, computed elsewhere, can be the chain from ``prev`` over
    the pages packed in ``data``: one hash a page, and the first and last pages
    hash to theirs (two SHA-256 calls whatever the length). It proves the answer
    is for these pages after this prefix; the middle is taken on trust from the
    fabric's own storage actor (checking each hash's type would cost a pass over
    them on the coordinator, which this check exists to spare)."""
    n = len(data) // page_bytes
    if len(hashes) != n:
        return False
    if n == 0:
        return True
    sha256 = hashlib.sha256
    if hashes[0] != sha256(prev + data[:page_bytes]).digest():
        return False
    if n == 1:
        return True
    before = hashes[-2]
    if not isinstance(before, bytes):
        return False
    return hashes[-1] == sha256(before + data[(n - 1) * page_bytes : n * page_bytes]).digest()


class TokenKey:
    """A request's key: namespace and token ids, cut to whole pages.

    ``data`` holds only the page-aligned part; ``num_tokens`` counts it. The
    unaligned tail of the input is never cached. Page hashes are computed on
    first use and kept — all of them (``page_hashes``), or those from some page
    on (``chain_from``), so a request's pages are hashed once whoever needs them.
    """

    __slots__ = ("_from", "_hashes", "data", "namespace", "page_bytes", "page_size")

    def __init__(
        self, tokens: Sequence[int] | bytes, page_size: int, namespace: str = DEFAULT_NAMESPACE
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidInput(f"page_size {page_size!r} is refused: allowed is an int >= 1")
        self.namespace = check_namespace(namespace)
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        data = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        if isinstance(tokens, bytes) and len(data) % TOKEN_BYTES:
            raise InvalidInput(f"packed tokens of {len(data)} bytes are not whole uint32 tokens")
        self.data = data[: len(data) - len(data) % self.page_bytes]
        check_unseeded(self.namespace, self.data)
        self._hashes: list[bytes] | None = None
        self._from = 0  # _hashes holds the hashes of pages _from, _from + 1, ...

    @property
    def num_tokens(self) -> int:
        return len(self.data) // TOKEN_BYTES

    @property
    def num_pages(self) -> int:
        return len(self.data) // self.page_bytes

    def tokens(self) -> list[int]:
        return unpack_tokens(self.data)

    def page_hashes(self) -> list[bytes]:
        """The SHA-256 chain over every page of the key (computed once)."""
        if self._hashes is None or self._from:
            self._hashes = chain_hashes(namespace_seed(self.namespace), self.data, self.page_bytes)
            self._from = 0
        return self._hashes

    def chain_from(self, start_page: int, prev: bytes) -> list[bytes]:
        """The hashes of pages ``start_page`` on, given ``prev``, the chain hash of
        the pages before it (the caller vouches for it). Kept for ``known_hashes``."""
        known = self.known_hashes(start_page)
        if known is not None:
            return known
        self._hashes = chain_hashes(
            prev, self.data[start_page * self.page_bytes :], self.page_bytes
        )
        self._from = start_page
        return self._hashes

    def keep_hashes(self, start_page: int, hashes: Sequence[bytes]) -> None:
        """Keep ``hashes``, computed elsewhere, as the chain of pages ``start_page``
        on (the caller checked them: ``answers_chain``). Hashes known already from
        ``start_page`` or before stay."""
        if self.known_hashes(start_page) is None:
            self._hashes, self._from = list(hashes), start_page

    def known_hashes(self, start_page: int) -> list[bytes] | None:
        """The hashes of pages ``start_page`` on if already computed, else ``None``."""
        if self._hashes is None or start_page < self._from:
            return None
        return self._hashes[start_page - self._from :]

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"TokenKey(namespace={self.namespace!r}, tokens={self.num_tokens})"
