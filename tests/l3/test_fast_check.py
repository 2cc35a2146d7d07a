"""``FastCheck`` passes a page without decoding its header; it must never pass a
page that ``check_record`` (the full check every read path makes) refuses."""

from __future__ import annotations

import os

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.l3.auth import PageAuth
from fabric.l3.format import FastCheck, Provenance, check_record, checksum, encode_header
from tests.helpers import example_count

PROV = Provenance("m", "layer_first", "float16", (2, 16, 2, 2, 8), 16)
AUTH = PageAuth(b"k" * 32)
PAYLOAD = 512
KEY = f"{'ab' * 32}.{PROV.tag}.0-0-1"


def page(seed: int, auth) -> tuple[bytes, bytes]:
    payload = os.urandom(PAYLOAD) if seed < 0 else bytes([seed % 256]) * PAYLOAD
    return encode_header(payload, PROV, KEY, auth), payload


def test_the_pages_encode_header_writes_pass_and_others_fall_to_the_full_check():
    for auth in (None, AUTH):
        fast = FastCheck(PROV, PAYLOAD, auth)
        head, payload = page(-1, auth)
        assert fast(head, payload, KEY) and fast(bytearray(head), memoryview(payload), KEY)
        assert not fast(head, payload, KEY.replace("0-0-1", "0-0-2"))  # another shard's key
        assert not FastCheck(PROV, PAYLOAD + 1, auth)(head, payload, KEY)
        other_prov = Provenance("n", *list(PROV.__dict__.values())[1:6])
        assert not FastCheck(other_prov, PAYLOAD, auth)(head, payload, KEY)
    # Another encoder's field order: a valid page the full check serves, left to it.
    _, payload = page(-1, None)
    fields = {"prov": PROV.as_wire(), "v": 2, "key": KEY, "len": PAYLOAD}
    fields["sum"] = checksum(payload)
    body = msgpack.packb(fields, use_bin_type=True)
    head = b"KVFABRIC" + len(body).to_bytes(4, "little") + body
    assert check_record(head, payload, PROV, KEY) is None
    assert not FastCheck(PROV, PAYLOAD, None)(head, payload, KEY)


@settings(max_examples=example_count(300, 5000), deadline=None)
@given(
    auth=st.booleans(),
    seed=st.integers(0, 255),
    flips=st.lists(st.tuples(st.integers(0, 4096), st.integers(1, 255)), min_size=1, max_size=3),
    in_payload=st.booleans(),
    cut=st.integers(0, 8),
)
def test_a_damaged_page_the_fast_check_passes_is_one_the_full_check_serves(
    auth, seed, flips, in_payload, cut
):
    a = AUTH if auth else None
    head, payload = page(seed, a)
    target = bytearray(payload if in_payload else head)
    for at, bits in flips:
        target[at % len(target)] ^= bits
    if cut:
        target = target[: len(target) - cut] if not in_payload else target
    head, payload = (head, bytes(target)) if in_payload else (bytes(target), payload)
    if FastCheck(PROV, PAYLOAD, a)(head, payload, KEY):
        assert check_record(head, payload, PROV, KEY, a) is None
