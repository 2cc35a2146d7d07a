"""L3 keys over several storage actors (``fabric.l3.shards``), without Ray: the
owner function, hit queries that merge to what one store answers, a rank's
loads split by owner (short and refused pages included), and a whole fabric
over three shards: served from L3, cleared and detached across all, one shard
restarted."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.cache.keys import pack_tokens
from fabric.driver.local import LocalFabric
from fabric.l3.direct import DirectReads
from fabric.l3.service import StorageService
from fabric.l3.shards import (
    ShardedLink,
    StorageShards,
    jump_hash,
    jump_hashes,
    merge_rows,
    merge_stats,
    owner,
    positions,
)
from tests.helpers import example_count, prompt, small_config

HYBRIDS = {
    "full": (),
    "sliding": ("model.layer_kinds=[full, sliding]", "model.sliding_window=6"),
    "mamba": ("model.layer_kinds=[full, mamba]",),
}


def config(tmp_path, actors: int, *more: str, backend: str = "segment"):
    return small_config(
        f"storage.backend={backend}",
        f"storage.path={tmp_path / 'l3'}",
        f"storage.actors={actors}",
        "prefetch.threshold_tokens=4",
        "storage.transfer_batch_pages=2",
        *more,
    )


# -- the owner function -------------------------------------------------------------


def test_jump_hash_moves_only_the_new_bucket_s_share_and_spreads_evenly():
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    for n in range(1, 9):
        before = [jump_hash(k, n) for k in keys]
        after = [jump_hash(k, n + 1) for k in keys]
        moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert all(b == n for _, b in moved), "a key moves only to the new bucket"
        share = len(moved) / len(keys)
        assert abs(share - 1 / (n + 1)) < 0.02, (n, share)
        counts = Counter(after)
        assert set(counts) == set(range(n + 1))
        assert max(counts.values()) / min(counts.values()) < 1.2, counts
    with pytest.raises(ValueError, match="buckets=0 is refused"):
        jump_hash(1, 0)


def test_jump_hashes_at_once_are_the_one_at_a_time_answers():
    rng = random.Random(3)
    keys = [rng.getrandbits(64) for _ in range(20_000)] + [0, 1, (1 << 64) - 1]
    for n in (1, 2, 3, 8, 64, 1000):
        assert jump_hashes(np.array(keys, dtype=np.uint64), n).tolist() == [
            jump_hash(k, n) for k in keys
        ]


def test_positions_split_a_chain_by_owner_in_order():
    hashes = [random.Random(i).randbytes(32) for i in range(50)]
    split = positions(hashes, 3)
    assert sorted(p for pos in split for p in pos) == list(range(50))
    for s, pos in enumerate(split):
        assert pos == sorted(pos) and all(owner(hashes[p], 3) == s for p in pos)
    assert positions(hashes, 1) == [list(range(50))]


# -- hit queries: N shards answer what one store answers --------------------------


class KeySet:
    """A backend that holds exactly these keys (for the hit query's logic)."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def exists(self, keys):
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def present(self, keys):
        return [k in self.keys for k in keys]


@settings(max_examples=example_count(150, 3000), deadline=None)
@given(
    kind=st.sampled_from(sorted(HYBRIDS)),
    shards=st.integers(2, 5),
    pages=st.integers(0, 12),
    held=st.data(),
)
def test_a_hit_query_over_shards_is_what_one_store_answers(
    tmp_path_factory, kind, shards, pages, held
):
    tmp = tmp_path_factory.mktemp("q")
    one = StorageService(config(tmp, 1, *HYBRIDS[kind], backend="none"))
    many = StorageShards(
        [
            StorageService(config(tmp, shards, *HYBRIDS[kind], backend="none"), s)
            for s in range(shards)
        ]
    )
    tokens = pack_tokens(list(range(1000, 1000 + 4 * pages)))
    hashes = one.answer(b"", tokens).hashes
    # Every (page, rank shard, component) key present or not, mostly present.
    keys = {
        one.key(h, suffix, component)
        for h in hashes
        for suffix in one.suffixes
        for component in ("full", *one.parts)
    }
    present = {k for k in sorted(keys) if held.draw(st.integers(0, 9), label=k[:8]) > 0}
    one.backend = KeySet(present)
    for service in many.services:
        service.backend = KeySet(present)
    assert many.answer(b"", tokens) == one.answer(b"", tokens)


def test_a_shard_without_a_backend_makes_the_whole_query_miss(tmp_path):
    shards = StorageShards([StorageService(config(tmp_path, 2), s) for s in range(2)])
    tokens = pack_tokens(prompt(1, pages=6))
    keys = {
        shards.key(h, sfx) for h in shards.answer(b"", tokens).hashes for sfx in shards.suffixes
    }
    for service in shards.services:
        service.backend.close()
        service.backend = KeySet(keys)
    assert shards.answer(b"", tokens).pages == 6
    shards.services[1].backend = None
    assert shards.answer(b"", tokens).pages == 0


# -- a rank's pages over shards ----------------------------------------------------


def test_merge_rows_keeps_the_leading_run_every_owner_returned():
    split = [[0, 2, 5], [1, 3], [4]]
    rows = [
        np.full((3, 2), 10, np.uint8),
        np.full((1, 2), 20, np.uint8),
        np.full((1, 2), 30, np.uint8),
    ]
    out = merge_rows(split, rows, 2)
    assert out.shape == (3, 2) and list(out[:, 0]) == [10, 20, 10], "shard 1 stopped before 3"
    full = merge_rows(split, [rows[0], np.full((2, 2), 20, np.uint8), rows[2]], 2)
    assert list(full[:, 0]) == [10, 20, 10, 20, 30, 10]


def stored_pages(tmp_path, shards: int, backend: str = "segment"):
    """``shards`` storage services on one store, and a rank shard's 12 pages
    stored through a sharded link."""
    cfg = config(tmp_path, shards, backend=backend)
    services = [StorageService(cfg, s) for s in range(shards)]
    link = ShardedLink(services)
    suffix = services[0].suffixes[0]
    width = services[0].page_bytes
    hashes = [random.Random(i).randbytes(32) for i in range(12)]
    rows = np.random.default_rng(0).integers(0, 256, (12, width), dtype=np.uint8)
    assert link.store(suffix, hashes, rows)
    return cfg, services, link, suffix, hashes, rows


def test_a_sharded_link_loads_what_it_stored_and_each_owner_wrote_its_share(tmp_path):
    _, services, link, suffix, hashes, rows = stored_pages(tmp_path, 3)
    assert np.array_equal(link.load(suffix, hashes), rows)
    written = [s.stats()["set_pages"] for s in services]
    assert written == [len(p) for p in positions(hashes, 3)] and sum(written) == 12
    assert all(written), "every shard owns some of 12 pages"
    stats = merge_stats([s.stats() for s in services])
    assert stats["set_pages"] == 12 and stats["actors"] == 3


@pytest.mark.parametrize("direct", [False, True], ids=["through-actor", "direct"])
def test_a_missing_page_is_a_short_load_and_a_corrupted_one_is_refused(tmp_path, direct):
    cfg, services, link, suffix, hashes, rows = stored_pages(tmp_path, 3)
    reader = DirectReads(link, cfg) if direct else link
    # A page the store never had: the load stops before it.
    gone = random.Random(99).randbytes(32)
    asked = [*hashes[:5], gone, *hashes[5:]]
    got = reader.load(suffix, asked)
    assert np.array_equal(got, rows[:5])
    # A page corrupted on disk (one byte of its payload): refused, the load stops there.
    victim = 7
    where = services[owner(hashes[victim], 3)].locate(suffix, [hashes[victim]])
    root, (loc,) = where
    with open(f"{root}/{loc.file}", "r+b") as f:
        f.seek(loc.offset + loc.head + 3)
        byte = f.read(1)
        f.seek(loc.offset + loc.head + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = reader.load(suffix, hashes)
    assert np.array_equal(got, rows[:victim])
    refused = merge_stats([s.stats() for s in services])
    if direct:
        assert reader.direct_pages > 0 and reader.refused, "read directly, and refused there"
    else:
        assert refused.get("refused_checksum", 0) >= 1, refused


# -- a fabric over three shards ----------------------------------------------------


def test_a_fabric_over_three_shards_serves_clears_detaches_and_survives_a_shard_restart(
    tmp_path,
):
    cfg = config(tmp_path, 3)
    f = LocalFabric(cfg)
    tokens = pack_tokens(prompt(1, pages=8))
    r = f.serve(tokens)
    f.core.release(r.lease)
    f.settle()
    # The shards wrote their shares: 8 pages of every rank's shard (TP2 x PP2).
    written = [s.stats().get("set_pages", 0) for s in f.storage.services]
    assert sum(written) == 32 and sum(map(bool, written)) >= 2, written
    # A fresh fabric on the same shards: every page from L3, verified on every rank.
    g = LocalFabric(cfg, storage=f.storage)
    r = g.serve(tokens)
    assert r.storage_hit_tokens == 32 and g.verify(r, tokens) == [True] * 4
    g.core.release(r.lease)
    g.settle()
    g.core.cache.check_integrity()
    # One shard restarted (a new process on the same store): it finds its pages.
    shards = f.storage.services
    shards[1].detach()
    shards[1] = StorageService(cfg, 1)
    f.storage = StorageShards(shards)
    h = LocalFabric(cfg, storage=f.storage)
    r = h.serve(tokens)
    assert r.storage_hit_tokens == 32 and h.verify(r, tokens) == [True] * 4
    h.core.release(r.lease)
    # Clear reaches every shard: nothing is served from L3 after it.
    assert h.clear_storage()
    assert all(s.stats()["pages"] == 0 for s in shards)
    k = LocalFabric(cfg, storage=h.storage)
    r = k.serve(tokens)
    assert r.storage_hit_tokens == 0 and k.verify(r, tokens) == [True] * 4
    k.core.release(r.lease)
    k.settle()
    # Detach and attach reach every shard.
    spec = k.storage.spec
    assert k.detach_storage()
    assert all(s.backend is None for s in shards)
    assert k.attach_storage(*spec) == "attached"
    assert all(s.spec == spec for s in shards)
    k.close()
    for fabric in (f, g, h):
        fabric.close()


def test_a_shard_index_out_of_range_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"storage shard 3 is refused: allowed is 0\.\.2"):
        StorageService(config(tmp_path, 3), 3)
    with pytest.raises(Exception, match=r"storage.actors.*an integer 1\.\.64"):
        config(tmp_path, 0)


def test_merged_figures_add_counters_and_keep_the_shared_store_s_size():
    a = {"attached": True, "pages": 10, "bytes": 100, "max_bytes": 1000, "get_pages": 3,
         "write_error": None, "backend": "segment", "sees_others": True}  # fmt: skip
    b = {"attached": True, "pages": 12, "bytes": 120, "max_bytes": 1000, "get_pages": 4,
         "write_error": "EROFS", "backend": "segment", "sees_others": True,
         "set_failed": 2}  # fmt: skip
    merged = merge_stats([a, b])
    assert merged == {
        "attached": True,
        "pages": 12,  # every actor sees the one store: its size is not a sum
        "bytes": 120,
        "max_bytes": 1000,
        "get_pages": 7,
        "write_error": "EROFS",  # any actor's failing write is the store's
        "backend": "segment",
        "sees_others": True,
        "set_failed": 2,
        "actors": 2,
    }
    assert merge_stats([a, {**b, "attached": False}])["attached"] is False
    assert merge_stats([a]) == a, "one actor's figures as they are"
    # Actors that each count their own pages (file): the sizes and caps add up.
    own = merge_stats([{**a, "sees_others": False}, {**b, "sees_others": False}])
    assert (own["pages"], own["bytes"], own["max_bytes"]) == (22, 220, 2000)


def test_file_actors_opened_on_a_full_store_each_count_only_the_pages_they_own(tmp_path):
    # One writer fills a file store; three actors then open it: each counts (and
    # may evict) only the pages it owns, so none is counted twice.
    _, services, _, _, hashes, _ = stored_pages(tmp_path, 1, backend="file")
    for s in services:
        s.detach()
    cfg = config(tmp_path, 3, backend="file")
    shards = [StorageService(cfg, s) for s in range(3)]
    assert [s.stats()["pages"] for s in shards] == [len(p) for p in positions(hashes, 3)]
    assert merge_stats([s.stats() for s in shards])["pages"] == len(hashes)
    for s in shards:
        s.detach()


def test_each_file_actor_keeps_its_share_of_the_cap_and_segment_actors_the_whole(tmp_path):
    # A file backend counts only what it wrote; a segment backend sees the whole
    # directory (rescanned before it evicts), so it keeps the whole cap.
    for backend, cap in (("file", 30_000), ("segment", 90_000)):
        cfg = config(tmp_path / backend, 3, "storage.max_bytes=90000", backend=backend)
        services = [StorageService(cfg, s) for s in range(3)]
        assert [s.backend.max_bytes for s in services] == [cap] * 3, backend
        for s in services:
            s.detach()


def test_segment_actors_keep_the_shared_directory_within_the_cap(tmp_path, monkeypatch):
    # Each actor counts every writer's segments (rescanned before it evicts; at
    # most once a second, here every time), so the directory stays within the
    # cap though each actor writes only its own share.
    import fabric.l3.segment as segment

    monkeypatch.setattr(segment, "RESCAN_S", 0.0)
    cfg = config(tmp_path, 3, "storage.max_bytes=6000")
    services = [StorageService(cfg, s) for s in range(3)]
    link = ShardedLink(services)
    suffix = services[0].suffixes[0]
    rows = np.zeros((4, services[0].page_bytes), dtype=np.uint8)
    for batch in range(30):
        hashes = [random.Random(batch * 10 + i).randbytes(32) for i in range(4)]
        link.store(suffix, hashes, rows)
        on_disk = sum(p.stat().st_size for p in (tmp_path / "l3").glob("seg-*.kvs"))
        assert on_disk <= 6000, (batch, on_disk)
    assert sum(s.stats().get("evicted_segments", 0) for s in services) > 0
    for s in services:
        s.detach()
