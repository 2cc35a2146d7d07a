"""An authenticated page's tag (``fabric.l3.auth.PageAuth``) binds the page's
key, its model tag and every payload byte, under AEGIS-128X4 for pages from
``AEGIS_FROM`` bytes and AES-GCM below; the nonce's length names the MAC, a
reader takes each (and the MAC mode's tags of stores written before), and
nothing else passes."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest

from fabric.errors import ConfigError
from fabric.l3.auth import AEGIS_FROM, AEGIS_MAC_NONCE, AEGIS_NONCE, GCM_NONCE, PageAuth
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
    "size, nonce", [(512, 12), (AEGIS_FROM - 1, 12), (AEGIS_FROM, 32), (1 << 20, 32)]
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


def signed_as(nonce: int, auth: PageAuth, page: np.ndarray) -> dict:
    """``page``'s tag fields under a ``nonce``-byte nonce, whatever its length
    (12: AES-GCM's, 16: AEGIS's MAC mode, as stores written before have them)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(PageAuth, "nonce_bytes", staticmethod(lambda n: nonce))
        return auth.sign(page, PROV, KEY)


def test_a_nonce_names_its_mac_and_no_other_length_or_mix_passes():
    auth, page = PageAuth(SECRET), payload(AEGIS_FROM)
    tags = {n: signed_as(n, auth, page) for n in (GCM_NONCE, AEGIS_MAC_NONCE, AEGIS_NONCE)}
    assert len(auth.sign(page, PROV, KEY)["nonce"]) == AEGIS_NONCE  # what is written
    for n, tag in tags.items():
        assert len(tag["nonce"]) == n and auth.verify(tag, KEY, PROV, page), n
        for other in tags:  # one MAC's tag under another's nonce length
            if other != n:
                nonce = tag["nonce"][:other].ljust(other, b"\0")
                assert not auth.verify({"nonce": nonce, "mac": tag["mac"]}, KEY, PROV, page)
        for length in (0, 8, 11, 13, 15, 17, 31, 33, 64):
            forged = {"nonce": tag["nonce"][:length].ljust(length, b"\0"), "mac": tag["mac"]}
            assert not auth.verify(forged, KEY, PROV, page), (n, length)
        for bad in ({}, {"nonce": tag["nonce"]}, {"nonce": "x" * n, "mac": tag["mac"]},
                    {"nonce": tag["nonce"], "mac": tag["mac"][:8]},
                    {"nonce": tag["nonce"], "mac": tag["mac"] + bytes(16)},
                    {"nonce": os.urandom(n), "mac": tag["mac"]}):  # fmt: skip
            assert not auth.verify(bad, KEY, PROV, page), (n, bad)


@pytest.mark.parametrize("nonce", [AEGIS_NONCE, AEGIS_MAC_NONCE, GCM_NONCE])
def test_threads_tagging_at_once_each_get_their_pages_tags(nonce):
    """One ``PageAuth`` shared by a rank's reader threads: tags made side by side
    (the MAC mode's from a state each thread keeps) are each the page's."""
    auth = PageAuth(SECRET)
    pages = [payload((1 << 20) + i) for i in range(4)]  # long tags: the threads overlap
    tags = [signed_as(nonce, auth, p) for p in pages]

    def check(i: int) -> bool:
        ok = True
        for _ in range(50):
            ok &= auth.verify(tags[i], KEY, PROV, pages[i])
            ok &= not auth.verify(tags[i], KEY, PROV, pages[(i + 1) % 4])
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, range(4)))


@pytest.mark.parametrize("nonce", [GCM_NONCE, AEGIS_MAC_NONCE])
@pytest.mark.parametrize("backend", ["file", "segment"])
def test_a_store_tagged_by_an_earlier_kvfabric_is_served_by_both_read_paths(
    tmp_path, monkeypatch, backend, nonce
):
    """Pages of 64 KiB an earlier kvfabric tagged with AES-GCM or AEGIS's MAC
    mode: each read path serves them (by the full check) and refuses a damaged
    one alike."""
    with monkeypatch.context() as m:
        m.setattr(PageAuth, "nonce_bytes", staticmethod(lambda n: nonce))
        cfg, writer, data = store(tmp_path, backend, "aegis")
    path, offset, head, _ = record(writer, 0)
    with open(path, "rb") as f:
        f.seek(offset + PREAMBLE)
        header = msgpack.unpackb(f.read(head - PREAMBLE))
    assert len(header["nonce"]) == nonce and data.shape[1] >= AEGIS_FROM
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


def test_without_pyaegis_cffi_module_its_class_makes_the_same_tags(monkeypatch):
    """Where ``pyaegis`` has no ``_aegis_ffi`` module (another release), its
    ``Aegis128X4`` class makes and checks the same AEGIS tags."""
    page, fast = payload(AEGIS_FROM + 3), PageAuth(SECRET)
    monkeypatch.setitem(sys.modules, "pyaegis._aegis_ffi", None)
    slow = PageAuth(SECRET)
    for signer, reader in ((fast, slow), (slow, fast), (slow, slow)):
        header = signer.sign(page, PROV, KEY)
        assert len(header["nonce"]) == AEGIS_NONCE and reader.verify(header, KEY, PROV, page)
        flipped = page.copy()
        flipped[7] ^= 1
        assert not reader.verify(header, KEY, PROV, flipped)
        assert not reader.verify({**header, "mac": bytes(16)}, KEY, PROV, page)
