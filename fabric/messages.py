"""Coordinator <-> rank messages: small frozen dataclasses with a versioned msgpack
encoding.

Every message on the wire is ``{"v": VERSION, "t": type name, ...fields}``.
Decoding refuses oversized input, unknown versions and types, extension types,
missing or unknown fields and values of the wrong type or range, with an
``InvalidMessage`` that names what was wrong; nothing malformed is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

from fabric.errors import InvalidInput

VERSION = 1
DEFAULT_MAX_BYTES = 64 << 20
_MAX_INT = 2**63 - 1


class InvalidMessage(InvalidInput):
    """A message that failed to decode or validate."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_INT


def _ints(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_int(x) for x in v)


def _str(v: Any) -> bool:
    if not (isinstance(v, str) and 0 < len(v) <= 256):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bytes(v: Any) -> bool:
    return isinstance(v, bytes)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


class Message:
    """Base of every wire message. ``CHECKS`` maps each field to its validator."""

    CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION, "t": type(self).__name__}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, tuple) and value and isinstance(value[0], Message):
                value = [m.to_wire() for m in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Message:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        given = set(data) - {"v", "t"}
        if given != names:
            raise InvalidMessage(
                f"{cls.__name__}: fields {sorted(given)} do not match {sorted(names)}"
            )
        values = {}
        for name in names:
            value = data[name]
            if not cls.CHECKS[name](value):
                raise InvalidMessage(f"{cls.__name__}.{name}={_short(value)} is invalid")
            values[name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _hash(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == 32


@dataclass(frozen=True)
class Compute(Message):
    """Fill L1 ``pages`` with KV for the packed ``tokens`` (``fabric.cache.keys`` format) at
    positions ``[start_token, start_token + len(tokens) // 4)``. ``start_token`` is
    page aligned and ``prev_hash`` is the page-hash chain up to it: a compute
    carries only its own tokens, never the prefix before them."""

    cmd_id: int
    namespace: str
    prev_hash: bytes
    tokens: bytes
    start_token: int
    pages: tuple[int, ...]
    CHECKS: ClassVar = {
        "cmd_id": _int,
        "namespace": _str,
        "prev_hash": _hash,
        "tokens": _bytes,
        "start_token": _int,
        "pages": _ints,
    }


@dataclass(frozen=True)
class Write(Message):
    """Copy L1 pages to L2 pages."""

    cmd_id: int
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    CHECKS: ClassVar = {"cmd_id": _int, "device_pages": _ints, "host_pages": _ints}


@dataclass(frozen=True)
class Load(Message):
    """Copy L2 pages to L1 pages."""

    cmd_id: int
    host_pages: tuple[int, ...]
    device_pages: tuple[int, ...]
    CHECKS: ClassVar = {"cmd_id": _int, "host_pages": _ints, "device_pages": _ints}


def _hashes(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_hash(h) for h in v)


@dataclass(frozen=True)
class Backup(Message):
    """Store L2 ``host_pages`` in L3 under ``page_hashes`` (this rank's shard of each)."""

    cmd_id: int
    host_pages: tuple[int, ...]
    page_hashes: tuple[bytes, ...]
    CHECKS: ClassVar = {"cmd_id": _int, "host_pages": _ints, "page_hashes": _hashes}


@dataclass(frozen=True)
class Prefetch(Message):
    """Read pages ``page_hashes`` from L3 into L2 ``host_pages``, in batches,
    reporting cumulative progress under ``op_id``."""

    cmd_id: int
    op_id: int
    host_pages: tuple[int, ...]
    page_hashes: tuple[bytes, ...]
    CHECKS: ClassVar = {"cmd_id": _int, "op_id": _int, "host_pages": _ints, "page_hashes": _hashes}


COMMANDS: dict[str, type[Message]] = {
    c.__name__: c for c in (Compute, Write, Load, Backup, Prefetch)
}


def _commands(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(c, dict) for c in v)


@dataclass(frozen=True)
class Batch(Message):
    """One step's commands for every rank, in the order to apply them. ``epoch``
    changes when the coordinator resets the fabric; a rank starts counting again
    then. ``incarnations`` names, per rank index, the incarnation the commands are
    for: a rank restarted since then holds none of their pages and applies none.
    Every command up to ``acked`` is committed: a rank forgets their failures."""

    epoch: int
    commands: tuple[Message, ...]
    stop: tuple[int, ...] = ()
    forget: tuple[int, ...] = ()
    incarnations: tuple[str, ...] = ()
    acked: int = 0
    CHECKS: ClassVar = {
        "acked": _int,
        "epoch": _int,
        "commands": _commands,
        "stop": _ints,
        "forget": _ints,
        "incarnations": lambda v: (
            isinstance(v, (list, tuple)) and all(isinstance(s, str) and len(s) <= 64 for s in v)
        ),
    }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Batch:
        raw = dict(data)
        commands = raw.get("commands")
        if not _commands(commands):
            raise InvalidMessage(f"Batch.commands={_short(commands)} is invalid")
        raw["commands"] = []
        batch = super().from_wire(raw)
        decoded = tuple(_decode_obj(c, COMMANDS) for c in commands)  # type: ignore[union-attr]
        return cls(
            batch.epoch,  # type: ignore[attr-defined]
            decoded,
            batch.stop,  # type: ignore[attr-defined]
            batch.forget,  # type: ignore[attr-defined]
            batch.incarnations,  # type: ignore[attr-defined]
            batch.acked,  # type: ignore[attr-defined]
        )


@dataclass(frozen=True)
class Report(Message):
    """A rank's counters, all at once: finished computes, writes, loads and
    backups since ``epoch`` began, the command ids that failed (cumulative in
    the epoch), and per prefetch ``(op_id, completed_tokens, finished,
    terminated)`` — finished: this rank writes its host pages no more."""

    rank: int
    incarnation: str
    epoch: int
    computes_done: int
    writes_done: int
    loads_done: int
    failed: tuple[int, ...]
    backups_done: int = 0
    prefetch: tuple[tuple[int, int, bool, bool], ...] = ()
    CHECKS: ClassVar = {
        "rank": _int,
        "incarnation": _str,
        "epoch": _int,
        "computes_done": _int,
        "writes_done": _int,
        "loads_done": _int,
        "failed": _ints,
        "backups_done": _int,
        "prefetch": lambda v: (
            isinstance(v, (list, tuple))
            and all(
                isinstance(e, (list, tuple))
                and len(e) == 4
                and _int(e[0])
                and _int(e[1])
                and _bool(e[2])
                and _bool(e[3])
                for e in v
            )
        ),
    }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Report:
        report = super().from_wire(data)
        entries = tuple(tuple(e) for e in report.prefetch)  # type: ignore[attr-defined]
        return cls(**{**report.__dict__, "prefetch": entries})  # type: ignore[arg-type]


MESSAGES: dict[str, type[Message]] = {c.__name__: c for c in (Batch, Report)}

# Upper bounds of encoded sizes, so a batch is cut to fit ``max_message_bytes``
# without encoding anything twice: a msgpack int takes at most 9 bytes, a str or
# bytes value 5 + its length, a 32-byte hash 34; field names and headers fit in
# ``_OVERHEAD``.
_OVERHEAD = 160
_INT = 9
_HASH = 34


def command_bound(cmd: Message) -> int:
    """At most how many bytes ``cmd`` takes inside an encoded ``Batch``."""
    if isinstance(cmd, Compute):
        return (
            _OVERHEAD
            + 4 * len(cmd.namespace)
            + len(cmd.tokens)
            + _HASH
            + _INT * len(cmd.pages)
        )
    if isinstance(cmd, (Write, Load)):
        return _OVERHEAD + _INT * (len(cmd.device_pages) + len(cmd.host_pages))
    if isinstance(cmd, (Backup, Prefetch)):
        return _OVERHEAD + (_INT + _HASH) * len(cmd.page_hashes)
    raise TypeError(f"{type(cmd).__name__} is not a command")


def batch_header_bound(world_size: int, stops: int, forgets: int) -> int:
    """At most how many bytes a ``Batch`` takes besides its commands."""
    return _OVERHEAD + 2 * _INT + _INT * (stops + forgets) + (5 + 64) * world_size


def pages_per_command(kind: str, budget: int, page_size: int, namespace_chars: int) -> int:
    """The most pages one command of ``kind`` (``compute``, ``copy`` or ``storage``)
    may carry within ``budget`` bytes; 0 when not even one fits."""
    per_page = {
        "compute": 4 * page_size + _INT,
        "copy": 2 * _INT,
        "storage": _INT + _HASH,
    }[kind]
    fixed = _OVERHEAD + (4 * namespace_chars + _HASH if kind == "compute" else 0)
    return max(0, (budget - fixed) // per_page)


def _reject_ext(code: int, data: bytes) -> Any:
    raise InvalidMessage(f"msgpack extension type {code} is not allowed")


def encode(message: Message) -> bytes:
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Decode and validate one top-level message (``Batch`` or ``Report``). Raises
    ``InvalidMessage`` — and nothing else — for any input that is not one."""
    if not isinstance(data, (bytes, bytearray)):
        raise InvalidMessage(f"a message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise InvalidMessage(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
        )
    except InvalidMessage:
        raise
    except Exception as exc:
        raise InvalidMessage(f"message does not decode: {exc}") from None
    try:
        return _decode_obj(obj, MESSAGES)
    except InvalidMessage:
        raise
    except Exception as exc:  # RecursionError, TypeError, ...: malformed, whatever the cause
        raise InvalidMessage(f"message is malformed ({type(exc).__name__})") from None


def _decode_obj(obj: Any, known: dict[str, type[Message]]) -> Message:
    if not isinstance(obj, dict):
        raise InvalidMessage(f"a message must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != VERSION:
        raise InvalidMessage(f"message version {_short(version)} is not {VERSION}")
    kind = obj.get("t")
    cls = known.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidMessage(f"message type {_short(kind)} is unknown; known: {sorted(known)}")
    return cls.from_wire(obj)
