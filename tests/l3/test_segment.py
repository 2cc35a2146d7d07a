"""The segment L3: pages appended to a few large files, an index rebuilt from
them, the same integrity checks as a page file, batched reads, torn tails,
several writers, a size cap by whole segments."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from fabric.cache.keys import pack_tokens
from fabric.errors import ConfigError
from fabric.l3 import make_backend
from fabric.l3 import segment as segment_module
from fabric.l3.format import Provenance
from fabric.l3.segment import SegmentBackend
from tests.helpers import PAGE_BYTES, PROV, keys, pages, prompt

from .test_l3_trust import serve_checked
from .test_storage_fabric import config, fill_l3


def backend(root, **options) -> SegmentBackend:
    return SegmentBackend(PROV, PAGE_BYTES, {"path": str(root), **options})


def segments(root) -> list:
    return sorted(root.glob("seg-*.kvs"))


def read(b, ks) -> tuple[int, np.ndarray]:
    out = np.zeros((len(ks), PAGE_BYTES), dtype=np.uint8)
    return b.get(ks, out), out


def test_pages_round_trip_in_one_segment_file(tmp_path):
    b = backend(tmp_path / "l3")
    data = pages(300)
    assert b.set(keys(100), data[:100]) == [True] * 100
    assert b.set(keys(200, start=100), data[100:]) == [True] * 200
    assert b.exists(keys(301)) == 300
    n, out = read(b, keys(300))
    assert n == 300 and np.array_equal(out, data)
    assert len(segments(tmp_path / "l3")) == 1 and b.stats()["files"] == 1
    assert b.stats()["pages"] == 300


def test_a_run_of_pages_written_together_is_read_in_one_call(tmp_path, monkeypatch):
    b = backend(tmp_path / "l3")
    b.set(keys(64), pages(64))
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(1) or real(*a))
    n, out = read(b, keys(64))
    assert n == 64 and np.array_equal(out, pages(64))
    assert len(calls) == 1


def test_a_new_backend_rebuilds_the_index_from_the_segments(tmp_path):
    root = tmp_path / "l3"
    backend(root).set(keys(5), pages(5))
    again = backend(root)
    assert again.stats()["pages"] == 5
    n, out = read(again, keys(5))
    assert n == 5 and np.array_equal(out, pages(5))
    again.set(keys(1, start=9), pages(1, seed=3))
    assert len(segments(root)) == 2, "a writer never appends to a segment it did not create"


def test_a_torn_tail_is_left_out_and_the_rest_is_served(tmp_path):
    root = tmp_path / "l3"
    backend(root).set(keys(4), pages(4))
    (seg,) = segments(root)
    size = seg.stat().st_size
    os.truncate(seg, size - 7)  # the writer died in the middle of the last page
    b = backend(root)
    assert b.stats()["pages"] == 3 and b.stats()["segment_torn_tails"] == 1
    assert b.exists(keys(4)) == 3
    n, out = read(b, keys(4))
    assert n == 3 and np.array_equal(out[:3], pages(4)[:3])


def test_a_segment_torn_in_its_first_record_serves_nothing_and_is_counted(tmp_path):
    root = tmp_path / "l3"
    backend(root).set(keys(1), pages(1))
    (seg,) = segments(root)
    os.truncate(seg, 40)
    b = backend(root)
    assert b.stats()["pages"] == 0 and b.stats()["segment_torn_tails"] == 1
    assert read(b, keys(1))[0] == 0 and b.stats()["segment_torn_tails"] == 1


@pytest.mark.parametrize("where", ["magic", "key length", "page length", "key"])
def test_one_damaged_frame_costs_one_record_not_the_segment_s_tail(tmp_path, where):
    """A flipped byte in one record's frame (magic, lengths or key) drops
    that record only: the scan goes on at the next whole frame, and counts the
    damage as a corrupt record, not a torn tail."""
    root = tmp_path / "l3"
    backend(root).set(keys(64), pages(64))
    (seg,) = segments(root)
    data = bytearray(seg.read_bytes())
    starts = [i for i in range(len(data)) if data[i : i + 4] == segment_module._MAGIC]
    assert len(starts) == 64
    # The frame: magic (4 bytes), key length (2), page length (4), then the key.
    at = starts[10] + {"magic": 0, "key length": 4, "page length": 9, "key": 12}[where]
    data[at] ^= 0xFF
    seg.write_bytes(bytes(data))
    b = backend(root)
    st = b.stats()
    assert st["pages"] == 63, st
    assert st["segment_corrupt_records"] == 1 and "segment_torn_tails" not in st
    n, out = read(b, keys(64)[11:])
    assert n == 53 and np.array_equal(out, pages(64)[11:])
    assert b.exists(keys(10)) == 10 and b.exists(keys(64)[10:11]) == 0


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def test_a_flipped_payload_bit_is_a_counted_checksum_refusal(tmp_path):
    root = tmp_path / "l3"
    b = backend(root)
    b.set(keys(3), pages(3))
    (seg,) = segments(root)
    _flip(seg, seg.stat().st_size - 1)  # the last page's last byte
    n, _ = read(b, keys(3))
    assert n == 2 and b.stats()["refused_checksum"] == 1
    n, _ = read(backend(root), keys(3))
    assert n == 2, "also for a backend that rebuilt its index"


def test_a_record_moved_under_another_key_is_never_served(tmp_path):
    # Rewrite the frame of page 1 to say it is page 0: the index now sends page 0's
    # reads to page 1's bytes, whose header names page 1. Refused, by key.
    root = tmp_path / "l3"
    backend(root).set(keys(2), pages(2))
    (seg,) = segments(root)
    blob = seg.read_bytes()
    k0, k1 = (k.encode() for k in keys(2))
    at = blob.index(k1)
    seg.write_bytes(blob[:at] + k0 + blob[at + len(k1) :])
    b = backend(root)
    n, _ = read(b, keys(1))
    assert n == 0 and b.stats()["refused_key"] == 1


def test_a_page_of_another_provenance_is_a_provenance_refusal(tmp_path):
    root = tmp_path / "l3"
    other = Provenance("other", "layer_first", "bfloat16", (2, 4, 1, 1, 8), 4)
    SegmentBackend(other, PAGE_BYTES, {"path": str(root)}).set(keys(1), pages(1))
    b = backend(root)
    n, _ = read(b, keys(1))
    assert n == 0 and b.stats()["refused_provenance"] == 1


def test_two_writers_share_a_directory_and_see_each_others_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(segment_module, "RESCAN_S", 0.0)
    root = tmp_path / "l3"
    a, b = backend(root), backend(root)
    a.set(keys(3), pages(3))
    b.set(keys(2, start=3), pages(2, seed=1))
    n, out = read(b, keys(3))
    assert n == 3 and np.array_equal(out, pages(3)), "b picks up a's segment on a miss"
    assert a.exists(keys(2, start=3)) == 2
    assert len(segments(root)) == 2


def test_a_failed_append_stores_nothing_and_leaves_whole_records(tmp_path, monkeypatch):
    root = tmp_path / "l3"
    b = backend(root)
    b.set(keys(2), pages(2))
    real = os.pwritev

    def short(fd, buffers, offset):
        real(fd, buffers[:2], offset)  # part of a record reached the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", short)
    assert b.set(keys(3, start=2), pages(3, seed=1)) == [False] * 3
    assert b.stats()["set_failed"] == 3
    monkeypatch.setattr(os, "pwritev", real)
    assert b.set(keys(1, start=5), pages(1, seed=2)) == [True]
    again = backend(root)
    assert again.exists(keys(2)) == 2 and again.exists(keys(3, start=2)) == 0
    assert again.exists(keys(1, start=5)) == 1
    assert "segment_torn_tails" not in again.stats()


def test_the_size_cap_drops_whole_segments_least_recently_used_first(tmp_path):
    root = tmp_path / "l3"
    b = backend(root, max_bytes=8 << 20)  # segments of 1 MiB: an eighth of the cap
    assert b.segment_bytes == 1 << 20
    batch, i = 100, 0
    while i * batch < 60_000 and b.stats().get("evicted_segments", 0) < 4:
        b.set(keys(batch, start=i * batch), pages(batch, seed=i))
        assert read(b, keys(1))[0] == 1  # page 0's segment is in use all along
        i += 1
    usage = b.stats()
    assert usage["evicted_segments"] == 4, "what it takes to write twice the cap"
    assert usage["bytes"] <= 8 << 20 and usage["files"] == len(segments(root)) <= 9
    assert usage["evicted_pages"] > 0 and usage["pages"] < i * batch
    assert b.exists(keys(1)) == 1, "read all along: kept"
    second = next(k for k in range(i * batch) if b.exists(keys(1, start=k)) == 0)
    assert second > 0, "the segment after page 0's, never read: gone"


def test_a_cap_smaller_than_a_segment_holds_on_disk_and_keeps_the_newest_pages(tmp_path):
    """``max_bytes`` of 20,000 bytes: what is on disk never passes it, and an
    eviction drops the oldest eighth, not the whole store."""
    root = tmp_path / "l3"
    b = backend(root, max_bytes=20_000)
    assert b.segment_bytes == 2_500
    for i in range(40):
        assert b.set(keys(2, start=2 * i), pages(2, seed=i)) == [True, True]
        on_disk = sum(f.stat().st_size for f in segments(root))
        assert on_disk <= 20_000 and b.stats()["bytes"] == on_disk
        n, out = read(b, keys(2, start=2 * i))
        assert n == 2 and np.array_equal(out, pages(2, seed=i)), "the newest pages stay"
    usage = b.stats()
    assert usage["evicted_segments"] > 0
    assert usage["bytes"] > 20_000 * 5 // 8, "an eviction took a segment, not the store"
    again = backend(root, max_bytes=20_000)
    assert again.stats()["pages"] == usage["pages"], "what is left rebuilds"


def test_segments_are_owner_only_and_a_linked_segment_is_not_followed(tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "l3"
        backend(root).set(keys(1), pages(1))
    finally:
        os.umask(old)
    (seg,) = segments(root)
    assert stat.S_IMODE(seg.stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    elsewhere = tmp_path / "elsewhere.kvs"
    seg.rename(elsewhere)
    seg.symlink_to(elsewhere)
    b = backend(root)
    assert b.exists(keys(1)) == 0 and b.stats()["refused_symlink"] == 1


def test_clear_removes_every_segment(tmp_path):
    root = tmp_path / "l3"
    b = backend(root)
    b.set(keys(3), pages(3))
    b.clear()
    assert segments(root) == [] and b.exists(keys(1)) == 0
    assert b.set(keys(1), pages(1)) == [True] and read(b, keys(1))[0] == 1


def test_make_backend_builds_it_and_refuses_a_small_segment(tmp_path):
    b = make_backend("segment", PROV, PAGE_BYTES, {"path": str(tmp_path), "segment_bytes": 1 << 22})
    assert isinstance(b, SegmentBackend) and b.segment_bytes == 1 << 22
    with pytest.raises(ConfigError, match="segment_bytes=10"):
        make_backend("segment", PROV, PAGE_BYTES, {"path": str(tmp_path), "segment_bytes": 10})


def test_a_fresh_fabric_serves_from_segments_an_earlier_one_wrote(tmp_path):
    cfg = config(tmp_path, "storage.backend=segment")
    tokens = pack_tokens(prompt(7, pages=8))
    fill_l3(cfg, tokens)
    r, stats = serve_checked(cfg, tokens)  # a new fabric: L1 and L2 empty, verified
    assert r.storage_hit_tokens == 32 and stats["backend"] == "segment"
    # 8 pages x 4 ranks in one file (the second fabric only read).
    assert len(segments(tmp_path / "l3")) == 1


def test_both_directory_backends_list_their_page_keys_for_audits(tmp_path):
    from fabric.l3.file import FileBackend

    for b in (
        backend(tmp_path / "seg"),
        FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "f")}),
    ):
        b.set(keys(3), pages(3))
        assert sorted(b.page_keys()) == sorted(keys(3))


def test_threads_storing_reading_and_evicting_at_once_never_get_wrong_bytes(tmp_path):
    # The storage actor serves many calls at once: appends, batched reads and
    # whole-segment evictions race. A read may miss or be refused, never return
    # another page's bytes, and nothing raises.
    from concurrent.futures import ThreadPoolExecutor

    b = backend(tmp_path / "l3", max_bytes=2 << 20)  # segments of 1 MiB, evicted often
    batch, rounds = 50, 150

    def writer(w: int) -> None:
        for i in range(rounds):
            start = (w * rounds + i) * batch
            assert b.set(keys(batch, start=start), pages(batch, seed=start)) == [True] * batch

    def reader(r: int) -> int:
        served = 0
        for i in range(rounds * 2):
            start = ((r + i) % (2 * rounds)) * batch
            out = np.zeros((batch, PAGE_BYTES), dtype=np.uint8)
            n = b.get(keys(batch, start=start), out)
            assert np.array_equal(out[:n], pages(batch, seed=start)[:n])
            served += n
        return served

    with ThreadPoolExecutor(6) as pool:
        writes = [pool.submit(writer, w) for w in range(2)]
        reads = [pool.submit(reader, r) for r in range(4)]
        for f in writes + reads:
            f.result()
    assert sum(f.result() for f in reads) > 0
    assert b.stats()["evicted_segments"] > 0 and b.stats()["bytes"] <= 2 << 20
    again = backend(tmp_path / "l3")  # what is left rebuilds and verifies
    assert again.stats()["pages"] == len(again.page_keys()) > 0
