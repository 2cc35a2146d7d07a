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
