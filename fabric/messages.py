"""Coordinator <-> rank messages: typed ``msgspec`` structs encoded as msgpack.

Every message on the wire is a map ``{"t": "<type name>/<VERSION>", ...fields}``:
the tag names the type and the version together, so neither can be missing.
Decoding validates against the types as it goes — unknown types, other
versions, extension types, missing or unknown fields, values of the wrong type
(a bool is not an int, a float not an int) or out of range, strings that are not
UTF-8 — and raises ``InvalidMessage`` naming where, and nothing else, whatever
the bytes. Oversized input is refused before decoding.

Every field has a type and both bounds the code relies on: an int its range, a
str or bytes value and a sequence their longest length (``MAX_ITEMS`` entries,
``MAX_BLOB`` bytes — the coordinator cuts commands to fit), a chain start is
empty or a 32-byte hash, packed tokens whole 4-byte tokens
(``tests/test_messages.py`` walks every field of every type and proves it).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from fabric.cache.keys import MAX_NAMESPACE_CHARS
from fabric.errors import InvalidInput

VERSION = 1
DEFAULT_MAX_BYTES = 64 << 20
# The most entries of one sequence field (a command's pages, a batch's commands)
# and bytes of one bytes field (a command's packed tokens); the largest message
# (``runtime.max_message_bytes``) is at most ``MAX_BLOB``.
MAX_ITEMS = 1 << 20
MAX_BLOB = 256 << 20

Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAMESPACE_CHARS)]
# A namespace or none (``Prefetch``: pages left unnamed).
OptionalName = Annotated[str, msgspec.Meta(min_length=0, max_length=MAX_NAMESPACE_CHARS)]
Hash = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
# Where a page-hash chain continues from: a page's hash, or a namespace's seed —
# empty for SGLang's unseeded chain (namespace ``sglang``, ``fabric.cache.keys``).
# Exactly 0 or 32 bytes (``_check_chain``).
ChainStart = Annotated[bytes, msgspec.Meta(min_length=0, max_length=32)]
Incarnation = Annotated[str, msgspec.Meta(min_length=0, max_length=64)]
# Packed tokens (``fabric.cache.keys.pack_tokens``): whole 4-byte tokens (``_check_tokens``).
Tokens = Annotated[bytes, msgspec.Meta(min_length=0, max_length=MAX_BLOB)]
Counts = Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_ITEMS)]
Hashes = Annotated[tuple[Hash, ...], msgspec.Meta(max_length=MAX_ITEMS)]


def _check_chain(prev_hash: bytes) -> None:
    if len(prev_hash) not in (0, 32):
        raise ValueError(f"prev_hash of {len(prev_hash)} bytes: allowed is 0 or 32")


def _check_tokens(name: str, tokens: bytes) -> None:
    if len(tokens) % 4:
        raise ValueError(f"{name} of {len(tokens)} bytes: allowed is whole 4-byte tokens")


class InvalidMessage(InvalidInput):
    """A message that failed to decode or validate."""


def _tag(name: str) -> str:
    return f"{name}/{VERSION}"


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="t", tag=_tag):
    """Base of every wire message (its ``t`` tag is ``<type name>/<VERSION>``)."""


class SlidingPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A hybrid model's sliding-window KV of key page ``page`` (its ``tokens``,
    after the page-hash chain ``prev_hash``), to store in sliding-pool page
    ``pool_page``."""

    page: Count
    pool_page: Count
    prev_hash: ChainStart
    tokens: Tokens

    def __post_init__(self) -> None:
        _check_chain(self.prev_hash)
        _check_tokens("tokens", self.tokens)


class MambaPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A hybrid model's mamba state after key page ``end_page - 1`` (the chain
    ``chain_hash`` through it), to store in state slot ``slot``."""

    end_page: Count
    slot: Count
    chain_hash: Hash


class Compute(_Message, frozen=True):
    """Fill L1 ``pages`` with KV for the packed ``tokens`` (``fabric.cache.keys``
    format) at positions ``[start_token, start_token + len(tokens) // 4)``.
    ``start_token`` is page aligned and ``prev_hash`` is the page-hash chain up to
    it: a compute carries only its own tokens — and, for a model that needs them
    (``model.filler``), the ``prefix`` tokens before them and the L1 pages that
    hold their KV (``prefix_pages``), which ranks that compute from the cache
    reuse. For a hybrid model: ``from_state``, the L1 mamba slot holding the
    state at ``start_token`` (the cache's: a rank forks a copy of it);
    ``window``, the sliding-pool pages holding the sliding window before
    ``start_token`` (the last key pages before it, in order); ``states_at``, the
    key pages in this command's span at whose end the parts commands that follow
    store a mamba state or the sliding KV of the page before (such a rank keeps
    them there, and runs the tokens between them in one piece). ``keep``: the
    first page already holds the KV of its first ``keep`` tokens (a request's own
    partial page, grown by a decode step): such a rank computes the tokens after
    them only."""

    cmd_id: Count
    namespace: Name
    prev_hash: ChainStart
    tokens: Tokens
    start_token: Count
    pages: Counts
    prefix: Tokens = b""
    prefix_pages: Counts = ()
    # A hybrid model's other components this compute also stores.
    sliding: Annotated[tuple[SlidingPart, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    mamba: Annotated[tuple[MambaPart, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    keep: Count = 0
    from_state: Counts = ()
    states_at: Counts = ()
    window: Counts = ()

    def __post_init__(self) -> None:
        _check_chain(self.prev_hash)
        _check_tokens("tokens", self.tokens)
        _check_tokens("prefix", self.prefix)


class Write(_Message, frozen=True):
    """Copy L1 pages to L2 pages (and a hybrid model's sliding pages and mamba
    state slots, L1 to L2)."""

    cmd_id: Count
    device_pages: Counts
    host_pages: Counts
    sliding_src: Counts = ()
    sliding_dst: Counts = ()
    mamba_src: Counts = ()
    mamba_dst: Counts = ()


class Load(_Message, frozen=True):
    """Copy L2 pages to L1 pages (and a hybrid model's components, L2 to L1)."""

    cmd_id: Count
    host_pages: Counts
    device_pages: Counts
    sliding_src: Counts = ()
    sliding_dst: Counts = ()
    mamba_src: Counts = ()
    mamba_dst: Counts = ()


class Backup(_Message, frozen=True):
    """Store L2 ``host_pages`` in L3 under ``page_hashes`` (this rank's shard of
    each), and a hybrid model's L2 sliding pages and mamba state slots under the
    chain hashes of their pages (``fabric.cache.controller.StorageParts``)."""

    cmd_id: Count
    host_pages: Counts
    page_hashes: Hashes
    sliding_pages: Counts = ()
    sliding_hashes: Hashes = ()
    mamba_slots: Counts = ()
    mamba_hashes: Hashes = ()


class Prefetch(_Message, frozen=True):
    """Read pages ``page_hashes`` from L3 into L2 ``host_pages``, in batches,
    reporting cumulative progress under ``op_id`` — a hybrid model's components
    (into L2 sliding pages and mamba slots) first: no progress until they are in."""

    cmd_id: Count
    op_id: Count
    host_pages: Counts
    page_hashes: Hashes
    # The pages' names (``fabric.rank.index``): namespace, the chain hash before
    # the first page and the pages' packed tokens; a restarted coordinator can
    # then adopt prefetched pages too. Empty: the pages stay unnamed.
    namespace: OptionalName = ""
    prev_hash: ChainStart = b""
    tokens: Tokens = b""
    sliding_pages: Counts = ()
    sliding_hashes: Hashes = ()
    mamba_slots: Counts = ()
    mamba_hashes: Hashes = ()

    def __post_init__(self) -> None:
        _check_chain(self.prev_hash)
        _check_tokens("tokens", self.tokens)


Command = Compute | Write | Load | Backup | Prefetch
# Every message type, for an ``isinstance`` check.
Message = _Message


class Batch(_Message, frozen=True):
    """One step's commands for every rank, in the order to apply them. ``epoch``
    changes when the coordinator resets the fabric; a rank starts counting again
    then. ``incarnations`` names, per rank index, the incarnation the commands are
    for: a rank restarted since then holds none of their pages and applies none.
    Every command up to ``acked`` is committed: a rank forgets their failures."""

    epoch: Count
    commands: Annotated[tuple[Command, ...], msgspec.Meta(max_length=MAX_ITEMS)]
    stop: Counts = ()
    forget: Counts = ()
    incarnations: Annotated[tuple[Incarnation, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    acked: Count = 0


class PrefetchProgress(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One prefetch as a rank sees it: cumulative ``completed_tokens``; ``finished``:
    this rank writes its host pages no more; ``terminated``: it stopped early."""

    op_id: Count
    completed_tokens: Count
    finished: bool
    terminated: bool


class Report(_Message, frozen=True):
    """A rank's counters, all at once: finished computes, writes, loads and
    backups since ``epoch`` began, the command ids that failed (cumulative in
    the epoch), and its view of every prefetch it knows."""

    rank: Count
    incarnation: Name
    epoch: Count
    computes_done: Count
    writes_done: Count
    loads_done: Count
    failed: Counts
    backups_done: Count = 0
    prefetch: Annotated[tuple[PrefetchProgress, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()


# Upper bounds of encoded sizes, so a batch is cut to fit ``max_message_bytes``
# without encoding anything twice: a msgpack int takes at most 9 bytes, a str or
# bytes value 5 + its length, a 32-byte hash 34; field names and headers fit in
# ``_OVERHEAD``.
_OVERHEAD = 160
_INT = 9
_HASH = 34
_PART = 5 + 2 * _INT + _HASH  # a component part without its tokens


def command_bound(cmd: Command) -> int:
    """At most how many bytes ``cmd`` takes inside an encoded ``Batch``."""
    if isinstance(cmd, Compute):
        tokens = len(cmd.tokens) + len(cmd.prefix)
        pages = len(cmd.pages) + len(cmd.prefix_pages)
        parts = sum(_PART + 5 + len(p.tokens) for p in cmd.sliding) + _PART * len(cmd.mamba)
        return _OVERHEAD + 4 * len(cmd.namespace) + tokens + _HASH + _INT * (pages + 1) + parts
    if isinstance(cmd, (Write, Load)):
        parts = (
            len(cmd.sliding_src) + len(cmd.sliding_dst) + len(cmd.mamba_src) + len(cmd.mamba_dst)
        )
        return _OVERHEAD + _INT * (len(cmd.device_pages) + len(cmd.host_pages) + parts)
    if isinstance(cmd, (Backup, Prefetch)):
        return _OVERHEAD + (_INT + _HASH) * len(cmd.page_hashes)
    raise TypeError(f"{type(cmd).__name__} is not a command")


def batch_header_bound(world_size: int, stops: int, forgets: int) -> int:
    """At most how many bytes a ``Batch`` takes besides its commands."""
    return _OVERHEAD + 2 * _INT + _INT * (stops + forgets) + (5 + 64) * world_size


def pages_per_command(kind: str, budget: int, page_size: int, namespace_chars: int) -> int:
    """The most pages one command of ``kind`` (``compute``, ``copy``, ``storage`` or
    ``prefetch``)
    may carry within ``budget`` bytes; 0 when not even one fits."""
    per_page = {
        "compute": 4 * page_size + _INT,
        "copy": 2 * _INT,
        "storage": _INT + _HASH,
        "prefetch": 4 * page_size + _INT + _HASH,
    }[kind]
    named = kind in ("compute", "prefetch")
    fixed = _OVERHEAD + (4 * namespace_chars + _HASH if named else 0)
    return min(MAX_ITEMS, max(0, (budget - fixed) // per_page))


def parts_per_command(budget: int, page_size: int, namespace_chars: int) -> int:
    """The most component parts (each at most a page of tokens and a hash) one
    compute may carry within ``budget`` bytes, at least 1."""
    fixed = _OVERHEAD + 4 * namespace_chars + _HASH
    return min(MAX_ITEMS, max(1, (budget - fixed) // (_PART + 5 + 4 * page_size)))


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch | Report)


def encode(message: Batch | Report) -> bytes:
    return _encoder.encode(message)


def decode(data: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> Batch | Report:
    """Decode and validate one top-level message (``Batch`` or ``Report``). Raises
    ``InvalidMessage`` — and nothing else — for any input that is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidMessage(f"a message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise InvalidMessage(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidMessage(f"message is invalid: {exc}") from None
    except Exception as exc:  # DecodeError, RecursionError, ...: malformed, whatever the cause
        raise InvalidMessage(f"message does not decode: {type(exc).__name__}: {exc}") from None
