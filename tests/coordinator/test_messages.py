"""Wire messages: typed structs that decode to a message or to ``InvalidMessage``,
never anything else, whatever the bytes."""

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric.messages import (
    Backup,
    Batch,
    Compute,
    InvalidMessage,
    Load,
    Prefetch,
    PrefetchProgress,
    Report,
    Write,
    decode,
    encode,
)

H = b"\x07" * 32


def test_round_trip_of_every_message():
    batch = Batch(
        3,
        (
            Compute(1, "ns", H, b"\x01\x00\x00\x00" * 4, 0, (5,)),
            Write(2, (5,), (9,)),
            Load(3, (9,), (6,)),
            Backup(4, (9,), (H,)),
            Prefetch(5, 17, (3,), (H,)),
        ),
        stop=(17,),
        forget=(2,),
        incarnations=("a", "b"),
        acked=3,
    )
    assert decode(encode(batch)) == batch
    report = Report(1, "abc", 3, 1, 1, 0, (2,), 4, (PrefetchProgress(17, 64, True, False),))
    assert decode(encode(report)) == report
    assert decode(encode(report)).prefetch[0].completed_tokens == 64


_REPORT = {
    "t": "Report/1",
    "rank": 0,
    "incarnation": "abc",
    "epoch": 1,
    "computes_done": 0,
    "writes_done": 0,
    "loads_done": 0,
    "failed": [],
    "backups_done": 0,
    "prefetch": [],
}
_BATCH = {"t": "Batch/1", "epoch": 1, "commands": [], "stop": [], "forget": []}


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"\xc1", "does not decode"),
        (msgpack.packb([1, 2]), "Expected `object`"),
        (msgpack.packb({**_BATCH, "t": "Batch/2"}), "'Batch/2'"),
        (msgpack.packb({"t": "Evil/1"}), "'Evil/1'"),
        (msgpack.packb({"epoch": 1}), "missing required field `t`"),
        (msgpack.packb({"t": "Batch/1", "epoch": 1}), "`commands`"),
        (msgpack.packb({**_BATCH, "epoch": -1}), r"\$\.epoch"),
        (msgpack.packb({**_BATCH, "extra": 1}), "unknown field `extra`"),
        (
            msgpack.packb(
                {**_BATCH, "commands": [{"t": "Write/1", "cmd_id": 1, "device_pages": [-1]}]}
            ),
            r"\$\.commands\[0\]\.device_pages",
        ),
        (msgpack.packb({**_BATCH, "commands": [_REPORT]}), "'Report/1'"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "does not decode|ext"),
        (msgpack.packb({**_REPORT, "incarnation": ""}), r"\$\.incarnation"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(wire, match):
    with pytest.raises(InvalidMessage, match=match):
        decode(wire)


def test_oversized_messages_are_refused_before_decoding():
    with pytest.raises(InvalidMessage, match="exceeds the limit"):
        decode(b"\x00" * 5000, max_bytes=4096)
    with pytest.raises(InvalidMessage, match="must be bytes"):
        decode("text")


@pytest.mark.parametrize(
    "wire",
    [
        msgpack.packb({**_REPORT, "t": True}),
        msgpack.packb({**_REPORT, "t": 1.0}),
        msgpack.packb({**_REPORT, "t": ["Report/1"]}),
        msgpack.packb({**_REPORT, "t": {"x": 1}}),
        msgpack.packb({**_REPORT, "rank": True}),
        msgpack.packb({**_REPORT, "epoch": 1.0}),
        msgpack.packb({**_REPORT, "incarnation": "\udcff"}, unicode_errors="surrogatepass"),
        msgpack.packb({**_REPORT, "failed": [[[]]]}),
        msgpack.packb({**_REPORT, "prefetch": [[1, 2, True]]}),
        b"\x91" * 200_000 + b"\x00",  # lists nested 200,000 deep
        msgpack.packb({**_REPORT, "failed": [[[[[[[[[[[[1]]]]]]]]]]]]}),
    ],
)
def test_decode_raises_only_invalid_message_for_malformed_types_versions_and_nesting(wire):
    with pytest.raises(InvalidMessage):
        decode(wire)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text().filter(_encodable)
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8).filter(_encodable), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["Report/1", "Batch/1"]),
    fields=st.dictionaries(
        st.sampled_from([*_REPORT, "commands", "stop", "forget", "incarnations", "acked"]),
        _values,
        max_size=8,
    ),
)
def test_decode_of_any_well_formed_msgpack_is_a_message_or_invalid_message(kind, fields):
    wire = msgpack.packb({**_REPORT, "t": kind, **fields})
    try:
        message = decode(wire)
    except InvalidMessage:
        return
    assert isinstance(message, (Report, Batch))


# -- every field of every message type is bounded ------------------------------------

import types  # noqa: E402
import typing  # noqa: E402

import msgspec  # noqa: E402

from fabric import messages  # noqa: E402

STRUCTS = [
    t
    for t in vars(messages).values()
    if isinstance(t, type) and issubclass(t, msgspec.Struct) and t.__module__ == messages.__name__
    and t is not messages._Message
]  # fmt: skip


def _meta(annotation) -> tuple[type, msgspec.Meta | None]:
    """The annotation's base type and its bounds (``None``: none given)."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        metas = [m for m in extra if isinstance(m, msgspec.Meta)]
        return base, metas[0] if metas else None
    return annotation, None


def _fields(struct: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(struct, include_extras=True)
    return [(name, hints[name]) for name in struct.__struct_fields__]


def _unbounded(annotation, where: str) -> list[str]:
    """Where ``annotation`` lacks a bound the code relies on (recursively)."""
    base, meta = _meta(annotation)
    if base is bool:
        return []
    if base is int:
        ok = meta is not None and meta.ge is not None and meta.le is not None
        return [] if ok else [f"{where}: int without ge and le"]
    if base in (str, bytes):
        return [] if meta is not None and meta.max_length is not None else [f"{where}: no max"]
    if typing.get_origin(base) is tuple:
        missing = [] if meta is not None and meta.max_length is not None else [f"{where}: no max"]
        return missing + _unbounded(typing.get_args(base)[0], f"{where}[]")
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        return []  # walked as a type of its own
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        return [u for arg in typing.get_args(base) for u in _unbounded(arg, where)]
    return [f"{where}: {base!r} is not a bounded type"]


def test_every_field_of_every_message_type_has_a_type_and_both_bounds():
    assert {s.__name__ for s in STRUCTS} >= {
        "Compute", "Write", "Load", "Backup", "Prefetch", "Batch", "Report",
        "SlidingPart", "MambaPart", "PrefetchProgress",
    }  # fmt: skip
    missing = [
        u
        for s in STRUCTS
        for name, ann in _fields(s)
        for u in _unbounded(ann, f"{s.__name__}.{name}")
    ]
    assert missing == []


def _valid(annotation):
    """The smallest valid value of ``annotation``."""
    base, meta = _meta(annotation)
    low = meta.min_length if meta is not None and meta.min_length else 0
    if base is bool:
        return False
    if base is int:
        return meta.ge if meta is not None and meta.ge is not None else 0
    if base is str:
        return "n" * max(low, 1) if low else ""
    if base is bytes:
        return b"\0" * low
    if typing.get_origin(base) is tuple:
        return ()
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        return _instance(base)
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        return _valid(typing.get_args(base)[0])
    raise AssertionError(f"no value for {annotation!r}")


def _instance(struct: type):
    return struct(**{n: _valid(a) for n, a in _fields(struct) if _required(struct, n)})


def _required(struct: type, name: str) -> bool:
    return (
        name
        not in struct.__struct_fields__[
            len(struct.__struct_fields__) - len(struct.__struct_defaults__) :
        ]
    )


def _plain(value):
    return msgspec.to_builtins(value, builtin_types=(bytes,))


def _wire(struct: type, field: str, value) -> bytes:
    """A top-level message holding a ``struct`` whose ``field`` is ``value``
    (encoded from plain values: the struct's own checks never run)."""
    inner = _plain(_instance(struct))
    fields = list(struct.__struct_fields__)
    if isinstance(inner, dict):
        inner[field] = value
    else:
        inner[fields.index(field)] = value
    if struct in (messages.Batch, messages.Report):
        top = inner
    elif struct is messages.PrefetchProgress:
        top = _plain(_instance(messages.Report))
        top["prefetch"] = [inner]
    else:
        top = _plain(_instance(messages.Batch))
        if struct in (messages.SlidingPart, messages.MambaPart):
            cmd = _plain(_instance(messages.Compute))
            cmd["sliding" if struct is messages.SlidingPart else "mamba"] = [inner]
            inner = cmd
        top["commands"] = [inner]
    return msgspec.msgpack.encode(top)


def _out_of_bounds(annotation) -> list:
    """Makers of values out of ``annotation``'s bounds (made when a test runs:
    some are large)."""
    base, meta = _meta(annotation)
    if base is bool:
        return [lambda: 2]
    if base is int:
        return [lambda: meta.ge - 1, lambda: meta.le + 1, lambda: True, lambda: 1.5]
    if base in (str, bytes):
        one = "x" if base is str else b"x"
        bad = [lambda: one * (meta.max_length + 1), lambda: 7]
        if meta.min_length:
            bad.append(lambda: one * (meta.min_length - 1))
        return bad
    if typing.get_origin(base) is tuple:
        element = typing.get_args(base)[0]
        inner = _out_of_bounds(element)
        bad = [lambda: [_builtin(element)] * (meta.max_length + 1)]
        if inner:
            bad.append(lambda: [inner[0]()])
        return bad
    return []


def _builtin(annotation):
    return _plain(_valid(annotation))


CASES = [
    pytest.param(s, name, make, id=f"{s.__name__}.{name}[{i}]")
    for s in STRUCTS
    for name, ann in _fields(s)
    for i, make in enumerate(_out_of_bounds(ann))
]


def test_every_type_has_a_valid_smallest_message():
    for s in STRUCTS:
        decode(_wire(s, s.__struct_fields__[0], _builtin(_fields(s)[0][1])))


@pytest.mark.parametrize(("struct", "field", "make"), CASES)
def test_a_value_out_of_its_fields_bounds_is_refused_by_decode(struct, field, make):
    wire = _wire(struct, field, make())
    with pytest.raises(InvalidMessage):
        decode(wire, max_bytes=len(wire))


@pytest.mark.parametrize(
    ("struct", "field"),
    [(messages.Compute, "prev_hash"), (messages.SlidingPart, "prev_hash"),
     (messages.Prefetch, "prev_hash")],
)  # fmt: skip
def test_a_chain_start_is_empty_or_a_whole_hash(struct, field):
    for n in (1, 31):
        with pytest.raises(InvalidMessage, match=f"prev_hash of {n} bytes: allowed is 0 or 32"):
            decode(_wire(struct, field, b"\x01" * n))
    with pytest.raises(InvalidMessage, match="length <= 32"):
        decode(_wire(struct, field, b"\x01" * 33))
    for n in (0, 32):
        decode(_wire(struct, field, b"\x01" * n))


@pytest.mark.parametrize(
    ("struct", "field"),
    [(messages.Compute, "tokens"), (messages.Compute, "prefix"),
     (messages.SlidingPart, "tokens"), (messages.Prefetch, "tokens")],
)  # fmt: skip
def test_packed_tokens_are_whole_four_byte_tokens(struct, field):
    with pytest.raises(InvalidMessage, match="whole 4-byte tokens"):
        decode(_wire(struct, field, b"\x01" * 6))
    decode(_wire(struct, field, b"\x01" * 8))
