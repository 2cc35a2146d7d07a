import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric.messages import Batch, Compute, InvalidMessage, Load, Report, Write, decode, encode


def test_round_trip_of_every_message():
    batch = Batch(
        3,
        (
            Compute(1, "ns", b"\x07" * 32, b"\x01\x00\x00\x00" * 4, 0, (5,)),
            Write(2, (5,), (9,)),
            Load(3, (9,), (6,)),
        ),
    )
    assert decode(encode(batch)) == batch
    report = Report(1, "abc", 3, 1, 1, 0, (2,))
    assert decode(encode(report)) == report


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"\xc1", "does not decode"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"v": 2, "t": "Batch"}), "version 2"),
        (msgpack.packb({"v": 1, "t": "Evil"}), "unknown"),
        (msgpack.packb({"v": 1, "t": "Batch", "epoch": 1}), "commands"),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "t": "Batch",
                    "epoch": -1,
                    "commands": [],
                    "stop": [],
                    "forget": [],
                    "incarnations": [],
                    "acked": 0,
                }
            ),
            "epoch",
        ),
        (msgpack.packb({"v": 1, "t": "Batch", "epoch": 1, "commands": [], "x": 1}), "do not match"),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "t": "Batch",
                    "epoch": 1,
                    "stop": [],
                    "forget": [],
                    "incarnations": [],
                    "acked": 0,
                    "commands": [
                        {"v": 1, "t": "Write", "cmd_id": 1, "device_pages": [1.5], "host_pages": []}
                    ],
                }
            ),
            "device_pages",
        ),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "t": "Batch",
                    "epoch": 1,
                    "stop": [],
                    "forget": [],
                    "incarnations": [],
                    "acked": 0,
                    "commands": [{"v": 1, "t": "Report"}],
                }
            ),
            "unknown",
        ),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension"),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "t": "Report",
                    "rank": 0,
                    "incarnation": "",
                    "epoch": 1,
                    "computes_done": 0,
                    "writes_done": 0,
                    "loads_done": 0,
                    "failed": [],
                    "backups_done": 0,
                    "prefetch": [],
                }
            ),
            "incarnation",
        ),
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


_REPORT = {
    "v": 1,
    "t": "Report",
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


@pytest.mark.parametrize(
    "wire",
    [
        msgpack.packb({**_REPORT, "v": True}),
        msgpack.packb({**_REPORT, "v": 1.0}),
        msgpack.packb({**_REPORT, "t": ["Report"]}),
        msgpack.packb({**_REPORT, "t": {"x": 1}}),
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
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text().filter(_encodable) | st.binary(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8).filter(_encodable), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["Report", "Batch"]),
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
