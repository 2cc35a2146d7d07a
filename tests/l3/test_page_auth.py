"""An authenticated page's tag (``fabric.l3.auth.PageAuth``) binds the page's
key, its model tag and every payload byte, under AEGIS-128X4 for pages from
``AEGIS_FROM`` bytes and AES-GCM below; the nonce's length names the MAC, a
reader takes either, and nothing else passes."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest

from fabric.errors import ConfigError
from fabric.l3.auth import AEGIS_FROM, PageAuth
from fabric.l3.direct import DirectReads
from fabric.l3.format import PREAMBLE, Provenance
from fabric.l3.service import StorageService

from .test_read_paths_agree import HASHES, SUFFIX, outcome, payload_bit, record, store

PROV = Provenance("m", "layer_first", "float16", (2, 16, 2, 2, 8), 16)
KEY = f"{'ab' * 32}.{PROV.tag}.0-0-1"
SECRET = b"the store's writers' secret"


def payload(size: int) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize(
    "size, nonce", [(512, 12), (AEGIS_FROM - 1, 12), (AEGIS_FROM, 16), (1 << 20, 16)]
)
def test_a_tag_binds_the_key_the_model_and_every_payload_byte(size, nonce):
    auth, page = PageAuth(SECRET), payload(size)
    header = auth.sign(page, PROV, KEY)
    assert len(header["nonce"]) == nonce and len(header["mac"]) == 16
    for same in (page, bytes(page), memoryview(page), bytearray(page)):
        assert auth.verify(header, KEY, PROV, same)
    assert PageAuth(SECRET).verify(header, KEY, PROV, page), "another process, the same secret"
    assert not auth.verify(header, KEY.replace("0-0-1", "0-0-2"), PROV, page)
    assert not auth.verify(header, KEY, Provenance("n", *list(PROV.__dict__.values())[1:6]), page)
    assert not PageAuth(os.urandom(32)).verify(header, KEY, PROV, page)
    assert not auth.verify(header, KEY, PROV, page[:-1])
    for at in (0, size // 2, size - 1):
        flipped = page.copy()
        flipped[at] ^= 1
        assert not auth.verify(header, KEY, PROV, flipped)
    other = auth.sign(page, PROV, KEY)
    assert other["nonce"] != header["nonce"] and other["mac"] != header["mac"]


def test_a_nonce_names_its_mac_and_no_other_length_or_mix_passes(monkeypatch):
    auth, page = PageAuth(SECRET), payload(AEGIS_FROM)
    tagged = auth.sign(page, PROV, KEY)
    with monkeypatch.context() as m:  # as a store written before AEGIS tags has it
        m.setattr(PageAuth, "nonce_bytes", staticmethod(lambda n: 12))
        older = auth.sign(page, PROV, KEY)
    assert len(older["nonce"]) == 12 and auth.verify(older, KEY, PROV, page)
    # A GCM tag under a 16-byte nonce, an AEGIS tag under 12: neither MAC's.
    assert not auth.verify(
        {"nonce": older["nonce"] + bytes(4), "mac": older["mac"]}, KEY, PROV, page
    )
    assert not auth.verify({"nonce": tagged["nonce"][:12], "mac": tagged["mac"]}, KEY, PROV, page)
    assert not auth.verify({"nonce": os.urandom(16), "mac": tagged["mac"]}, KEY, PROV, page)
    for n in (0, 8, 11, 13, 15, 17, 32):
        forged = {"nonce": tagged["nonce"][:n].ljust(n, b"\0"), "mac": tagged["mac"]}
        assert not auth.verify(forged, KEY, PROV, page)
    for bad in ({}, {"nonce": tagged["nonce"]}, {"nonce": "x" * 16, "mac": tagged["mac"]},
                {"nonce": tagged["nonce"], "mac": tagged["mac"][:8]}):  # fmt: skip
        assert not auth.verify(bad, KEY, PROV, page)


def test_threads_tagging_at_once_each_get_their_pages_tags():
    """One ``PageAuth`` shared by a rank's reader threads: each thread's MAC state
    is its own, so tags made side by side are each the page's."""
    auth = PageAuth(SECRET)
    pages = [payload((1 << 20) + i) for i in range(4)]  # long tags: the threads overlap
    tags = [auth.sign(p, PROV, KEY) for p in pages]

    def check(i: int) -> bool:
        ok = True
        for _ in range(50):
            ok &= auth.verify(tags[i], KEY, PROV, pages[i])
            ok &= not auth.verify(tags[i], KEY, PROV, pages[(i + 1) % 4])
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, range(4)))


@pytest.mark.parametrize("backend", ["file", "segment"])
def test_a_store_tagged_with_aes_gcm_only_is_served_by_both_read_paths(
    tmp_path, monkeypatch, backend
):
    """Pages of 64 KiB an earlier kvfabric tagged with AES-GCM: each read path
    serves them (by the full check) and refuses a damaged one alike."""
    with monkeypatch.context() as m:
        m.setattr(PageAuth, "nonce_bytes", staticmethod(lambda n: 12))
        cfg, writer, data = store(tmp_path, backend, "aegis")
    path, offset, head, _ = record(writer, 0)
    with open(path, "rb") as f:
        f.seek(offset + PREAMBLE)
        header = msgpack.unpackb(f.read(head - PREAMBLE))
    assert len(header["nonce"]) == 12 and data.shape[1] >= AEGIS_FROM
    writer.detach()
    service = StorageService(cfg)
    direct = DirectReads(service, cfg)
    rows = np.zeros_like(data)
    assert outcome(service, lambda: direct.load(SUFFIX, HASHES, out=rows)) == (len(HASHES), {})
    assert np.array_equal(rows, data)
    assert outcome(service, lambda: service.load(SUFFIX, HASHES)) == (len(HASHES), {})
    payload_bit(service)  # page 2's payload damaged: both paths stop there alike
    direct.plan(SUFFIX, HASHES)
    damaged = (2, {"refused_checksum": 1})
    assert outcome(service, lambda: direct.load(SUFFIX, HASHES, out=rows)) == damaged
    assert outcome(service, lambda: service.load(SUFFIX, HASHES)) == damaged
    direct.close()
    service.detach()


def test_without_pyaegis_a_secret_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyaegis", None)
    with pytest.raises(ConfigError, match=r"need pyaegis .*pip install 'kvfabric\[auth\]'"):
        PageAuth(SECRET)
