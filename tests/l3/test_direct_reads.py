"""Ranks read prefetches from L3 themselves (``storage.direct_reads``): the
storage actor says where pages lie and counts what was read; a damaged page is
refused as the backend would refuse it, a vanished one is a short prefetch, and
a rank that cannot open the store reads through the storage actor."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from fabric.cache.keys import pack_tokens
from fabric.driver.local import LocalFabric
from fabric.l3.direct import DirectReads
from fabric.l3.segment import SegmentBackend
from fabric.l3.service import StorageService, backend_spec, page_geometry
from tests.helpers import PAGE_BYTES, PROV, prompt

from .test_storage_fabric import config, fill_l3, page_file

TOKENS = pack_tokens(prompt(7, pages=8))


def serve(cfg, tokens=TOKENS):
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.error is None and f.verify(r, tokens) == [True] * 4
    return f, r


def read_by(f: LocalFabric) -> tuple[int, int]:
    """Pages the ranks read themselves, and through the storage service."""
    links = [w.storage_io.link for w in f.ranks]
    assert all(isinstance(link, DirectReads) for link in links)
    return sum(x.direct_pages for x in links), sum(x.relayed_pages for x in links)


@pytest.mark.parametrize("backend", ["file", "segment"])
def test_ranks_read_their_prefetch_themselves_and_the_store_counts_it(tmp_path, backend):
    cfg = config(tmp_path, f"storage.backend={backend}")
    fill_l3(cfg, TOKENS)
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 32 and r.computed_tokens == 0
    direct, relayed = read_by(f)
    assert direct == 8 * 4 and relayed == 0  # 8 pages, 4 shards, no byte through the service
    st = f.storage.stats()
    assert st["direct_pages"] == direct and st["get_pages"] == direct


def test_without_direct_reads_the_pages_come_through_the_storage_service(tmp_path):
    cfg = config(tmp_path, "storage.direct_reads=false")
    fill_l3(cfg, TOKENS)
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 32
    assert not any(isinstance(w.storage_io.link, DirectReads) for w in f.ranks)
    assert "direct_pages" not in f.storage.stats()


def test_a_damaged_page_read_directly_is_refused_and_counted_by_the_store(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    path = page_file(tmp_path, TOKENS, 5, "0-0-0")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # one payload bit
    path.write_bytes(bytes(data))
    f, r = serve(cfg)
    assert r.storage_hit_tokens < 32 and r.computed_tokens > 0
    assert f.storage.stats()["refused_checksum"] >= 1
    assert sum(w.storage_io.link.refused.get("checksum", 0) for w in f.ranks) >= 1


def test_a_page_file_that_vanished_after_the_query_is_a_short_prefetch(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    real = DirectReads.load
    gone = page_file(tmp_path, TOKENS, 3, "0-0-0")

    def load(self, *args, **kwargs):
        if gone.exists():  # after the hit query counted it, before the read
            os.unlink(gone)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DirectReads, "load", load)
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 12 and r.computed_tokens == 20
    assert read_by(f)[1] == 0
    f.core.cache.check_integrity()


def test_a_page_file_replaced_by_a_link_is_not_followed(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    victim = page_file(tmp_path, TOKENS, 4, "0-0-0")
    victim.unlink()
    victim.symlink_to(page_file(tmp_path, TOKENS, 1, "0-0-0"))
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 16
    assert f.storage.stats()["refused_symlink"] >= 1


def test_a_segment_cut_short_is_a_short_prefetch_never_bytes(tmp_path, monkeypatch):
    cfg = config(tmp_path, "storage.backend=segment")
    fill_l3(cfg, TOKENS)
    real = DirectReads.load
    segments = sorted((tmp_path / "l3").glob("seg-*.kvs"))

    def load(self, *args, **kwargs):
        for seg in segments:  # every shard's records from the third page on are gone
            size = seg.stat().st_size
            if size > 3000:
                os.truncate(seg, size * 3 // 8)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DirectReads, "load", load)
    f, r = serve(cfg)
    assert r.storage_hit_tokens < 32 and read_by(f)[1] == 0
    f.core.cache.check_integrity()


def test_a_rank_without_the_store_s_directory_reads_through_the_storage_service(
    tmp_path, monkeypatch
):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    from fabric.l3.service import StorageService

    real = StorageService.locate

    def elsewhere(self, *args, **kwargs):
        where = real(self, *args, **kwargs)
        return None if where is None else (str(tmp_path / "not-on-this-node"), where[1])

    monkeypatch.setattr(StorageService, "locate", elsewhere)
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 32
    assert read_by(f) == (0, 32)


def test_a_damaged_record_in_a_segment_run_ends_the_run_there(tmp_path):
    cfg = config(tmp_path, "storage.backend=segment")
    fill_l3(cfg, TOKENS)
    key = page_file(tmp_path, TOKENS, 5, "0-0-0").name.removesuffix(".kv")
    store = SegmentBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "l3")})
    (loc,) = store.locate([key])
    store.close()
    with open(tmp_path / "l3" / loc.file, "r+b") as seg:  # one payload bit of page 5
        seg.seek(loc.offset + loc.head + loc.payload // 2)
        byte = seg.read(1)[0]
        seg.seek(-1, 1)
        seg.write(bytes([byte ^ 0x01]))
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 20 and read_by(f)[1] == 0
    assert f.storage.stats()["refused_checksum"] == 1
    f.core.cache.check_integrity()


def test_a_store_directory_made_anew_under_a_rank_is_opened_again(tmp_path):
    """An operator replaced the directory (same path, new pages) and the storage
    actor attached it again: a rank's read of the old one is a short batch
    once, then it opens the new one."""
    cfg = config(tmp_path)
    service = StorageService(cfg)
    hashes = [bytes([i]) * 32 for i in range(6)]
    data = np.random.default_rng(0).integers(0, 256, (6, page_geometry(cfg)[1]), dtype=np.uint8)
    assert service.store("0-0-0", hashes, data)
    reader = DirectReads(service, cfg)
    assert len(reader.load("0-0-0", hashes)) == 6
    shutil.copytree(tmp_path / "l3", tmp_path / "l3-new")
    shutil.rmtree(tmp_path / "l3")
    (tmp_path / "l3-new").rename(tmp_path / "l3")
    service.detach()
    service.attach(*backend_spec(cfg.storage))
    assert len(reader.load("0-0-0", hashes)) == 0  # the directory it had open is gone
    again = reader.load("0-0-0", hashes)
    assert len(again) == 6 and np.array_equal(again, data)
    assert reader.relayed_pages == 0


def test_a_prefetch_asks_where_its_pages_lie_once_not_once_a_batch(tmp_path, monkeypatch):
    cfg = config(tmp_path)  # storage.transfer_batch_pages=2: 4 batches of an 8-page prefetch
    fill_l3(cfg, TOKENS)
    asked = []
    real = StorageService.locate

    def locate(self, suffix, page_hashes, component="full"):
        asked.append(len(page_hashes))
        return real(self, suffix, page_hashes, component)

    monkeypatch.setattr(StorageService, "locate", locate)
    f, r = serve(cfg)
    assert r.storage_hit_tokens == 32 and read_by(f) == (32, 0)
    assert asked == [8] * 4, asked  # one call per rank, for all 8 pages
