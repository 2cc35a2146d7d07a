"""``FastCheck`` passes a page without decoding its header; it must never pass a
page that ``check_record`` (the full check every read path makes) refuses."""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.l3.auth import AEGIS_FROM, PageAuth
from fabric.l3.format import FastCheck, Provenance, check_record, checksum, encode_header
from tests.helpers import example_count

PROV = Provenance("m", "layer_first", "float16", (2, 16, 2, 2, 8), 16)
AUTH = PageAuth(b"k" * 32)
PAYLOAD = 512
# Page lengths whose tags are AES-GCM's and AEGIS-128X4's (``PageAuth.nonce_bytes``).
SIZES = (PAYLOAD, AEGIS_FROM)
KEY = f"{'ab' * 32}.{PROV.tag}.0-0-1"


def page(seed: int, auth, size: int = PAYLOAD) -> tuple[bytes, bytes]:
    payload = os.urandom(size) if seed < 0 else bytes([seed % 256]) * size
    return encode_header(payload, PROV, KEY, auth), payload


@pytest.mark.parametrize("size", SIZES)
def test_the_pages_encode_header_writes_pass_and_others_fall_to_the_full_check(size):
    for auth in (None, AUTH):
        fast = FastCheck(PROV, size, auth)
        head, payload = page(-1, auth, size)
        assert fast(head, payload, KEY) and fast(bytearray(head), memoryview(payload), KEY)
        assert not fast(head, payload, KEY.replace("0-0-1", "0-0-2"))  # another shard's key
        assert not FastCheck(PROV, size + 1, auth)(head, payload, KEY)
        other_prov = Provenance("n", *list(PROV.__dict__.values())[1:6])
        assert not FastCheck(other_prov, size, auth)(head, payload, KEY)
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
    size=st.sampled_from(SIZES),
    seed=st.integers(0, 255),
    flips=st.lists(st.tuples(st.integers(0, 4096), st.integers(1, 255)), min_size=1, max_size=3),
    in_payload=st.booleans(),
    cut=st.integers(0, 8),
)
def test_a_damaged_page_the_fast_check_passes_is_one_the_full_check_serves(
    auth, size, seed, flips, in_payload, cut
):
    a = AUTH if auth else None
    head, payload = page(seed, a, size)
    target = bytearray(payload if in_payload else head)
    for at, bits in flips:
        target[at % len(target)] ^= bits
    if cut:
        target = target[: len(target) - cut] if not in_payload else target
    head, payload = (head, bytes(target)) if in_payload else (bytes(target), payload)
    if FastCheck(PROV, size, a)(head, payload, KEY):
        assert check_record(head, payload, PROV, KEY, a) is None


@settings(max_examples=example_count(200, 3000), deadline=None)
@given(
    auth=st.booleans(),
    size=st.sampled_from(SIZES),
    pages=st.integers(1, 12),
    damage=st.lists(
        st.tuples(st.integers(0, 11), st.booleans(), st.integers(0, 4096), st.integers(1, 255)),
        max_size=3,
    ),
    other_key=st.integers(-1, 11),
)
def test_a_run_checked_as_one_array_passes_exactly_what_page_by_page_passes(
    auth, size, pages, damage, other_key
):
    """``FastCheck.run`` (a run's headers as one array) serves the same leading
    pages as checking each page alone, and never one the full check refuses."""
    import numpy as np

    a = AUTH if auth else None
    keys = [f"{(bytes([i + 1]) * 32).hex()}.{PROV.tag}.0-0-1" for i in range(pages)]
    payloads = np.frombuffer(os.urandom(pages * size), np.uint8).reshape(pages, size).copy()
    heads = [bytearray(encode_header(payloads[i], PROV, keys[i], a)) for i in range(pages)]
    if len({len(h) for h in heads}) != 1:  # a checksum under 2**16: another length
        return
    for page, in_payload, at, bits in damage:
        page %= pages
        target = payloads[page] if in_payload else heads[page]
        target[at % len(target)] ^= bits
    if 0 <= other_key < pages:
        keys[other_key] = keys[other_key].replace("0-0-1", "0-0-2")
    array = np.array([list(h) for h in heads], dtype=np.uint8)
    fast = FastCheck(PROV, size, a)
    passed = fast.run(array, payloads, keys)
    assert passed == fast.one_by_one(array, payloads, keys)
    for i in range(passed):
        assert check_record(bytes(heads[i]), payloads[i], PROV, keys[i], a) is None
    if passed < pages and not damage:
        assert passed == other_key


@pytest.mark.parametrize("size", SIZES)
def test_a_whole_run_of_the_common_form_is_checked_without_a_page_by_page_pass(monkeypatch, size):
    import numpy as np

    for a in (None, AUTH):
        keys = [f"{(bytes([i + 1]) * 32).hex()}.{PROV.tag}.0-0-1" for i in range(8)]
        payloads = np.zeros((8, size), np.uint8)
        heads = []
        while len(heads) < 8:  # pages whose checksums take 4 bytes (the common form)
            payloads[len(heads)] = np.frombuffer(os.urandom(size), np.uint8)
            head = encode_header(payloads[len(heads)], PROV, keys[len(heads)], a)
            if checksum(payloads[len(heads)]) >= 1 << 16:
                heads.append(list(head))
        fast = FastCheck(PROV, size, a)
        monkeypatch.setattr(fast, "one_by_one", lambda *args: pytest.fail("page by page"))
        assert fast.run(np.array(heads, np.uint8), payloads, keys) == 8
