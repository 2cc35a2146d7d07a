"""A rank's L2 outside its process (fabric.rank.shared_l2): a rank restarted on its
node finds its pages and their names, the coordinator adopts what every rank
still names alike, and nothing torn or foreign is taken back."""

from __future__ import annotations

import os
import time

import pytest
import torch

from fabric.cache.keys import chain_hashes, pack_tokens
from fabric.driver.local import LocalFabric
from fabric.rank.shared_l2 import SharedL2, sweep_stale
from tests.helpers import prompt, small_config

GEOMETRY = {"shape": [4, 8], "dtype": "torch.float16", "pool_bytes": 64, "page_size": 4}
TB = 16  # token bytes of a page of 4 tokens


def names_of(store: SharedL2) -> dict:
    return {slot: (n.namespace, n.parent_hash, n.tokens) for slot, n in store.names().items()}


def test_names_and_bytes_outlive_the_process_that_wrote_them(tmp_path):
    path = tmp_path / "rank-0.l2"
    first = SharedL2(path, GEOMETRY, slots=3, token_bytes=TB)
    assert not first.reattached and first.names() == {}
    parent, tokens = b"\1" * 32, bytes(range(TB))
    first.put(2, "tenant-a", parent, tokens)
    first.pool[:4] = b"\x07\x07\x07\x07"
    first.put(0, "x" * 300, parent, tokens)  # too long a namespace: not kept
    assert names_of(first) == {2: ("tenant-a", parent, tokens)}
    assert first.names()[2].chain_hash == chain_hashes(parent, tokens, TB)[0]
    first.close()  # the process dies: nothing unlinks the file
    again = SharedL2(path, GEOMETRY, slots=3, token_bytes=TB)
    assert again.reattached and names_of(again) == {2: ("tenant-a", parent, tokens)}
    assert bytes(again.pool[:4]) == b"\x07\x07\x07\x07"
    again.drop(2)
    assert again.names() == {}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    again.close(unlink=True)
    assert not path.exists()


def test_a_torn_record_or_another_geometry_is_not_taken_back(tmp_path):
    path = tmp_path / "rank-0.l2"
    store = SharedL2(path, GEOMETRY, slots=2, token_bytes=TB)
    store.put(0, "a", b"\2" * 32, bytes(TB))
    store.put(1, "b", b"\3" * 32, bytes(TB))
    at = store._at(1) + 20  # a byte inside slot 1's record: as if killed mid-write
    store.view[at] ^= 0xFF
    assert set(store.names()) == {0}, "a record failing its CRC is no name"
    store.close()
    other = SharedL2(path, {**GEOMETRY, "shape": [8, 4]}, slots=2, token_bytes=TB)
    assert not other.reattached and other.names() == {}, "another pool: started empty"
    other.close(unlink=True)


def test_a_link_in_place_of_the_file_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / "rank-0.l2").symlink_to(target)
    with pytest.raises(OSError):
        SharedL2(tmp_path / "rank-0.l2", GEOMETRY, slots=1, token_bytes=TB)
    assert target.read_bytes() == b"keep"


def test_the_sweep_removes_only_files_nobody_holds_that_are_old(tmp_path):
    held = SharedL2(tmp_path / "kvfabric-a-1-0.l2", GEOMETRY, slots=1, token_bytes=TB)
    dead = SharedL2(tmp_path / "kvfabric-b-2-0.l2", GEOMETRY, slots=1, token_bytes=TB)
    dead.close()  # its process is gone: no lock on it
    young = SharedL2(tmp_path / "kvfabric-c-3-0.l2", GEOMETRY, slots=1, token_bytes=TB)
    young.close()
    old = time.time() - 7200
    for name in ("kvfabric-a-1-0.l2", "kvfabric-b-2-0.l2"):
        os.utime(tmp_path / name, (old, old))
    assert sweep_stale(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvfabric-a-1-0.l2", "kvfabric-c-3-0.l2"]
    held.close(unlink=True)


def first_pass(f: LocalFabric, prompts: list[bytes]) -> None:
    for tokens in prompts:
        f.core.release(f.serve(tokens).lease)
    f.settle()


def hit_tokens(f: LocalFabric, prompts: list[bytes]) -> tuple[int, int]:
    """(L1 + L2 hit tokens, L2 hit tokens) of a pass over ``prompts``, each verified."""
    hit = l2 = 0
    for tokens in prompts:
        r = f.serve(tokens)
        assert r.error is None and f.verify(r, tokens) == [True] * 4
        hit += r.device_hit_tokens + r.host_hit_tokens
        l2 += r.host_hit_tokens
        f.core.release(r.lease)
    return hit, l2


@pytest.mark.parametrize("shared", [True, False])
def test_a_restarted_rank_keeps_the_fabric_s_l2_when_l2_is_outside_its_process(tmp_path, shared):
    """L3 off. A pass fills L1 and L2; a second pass hits; rank 2 restarts (its
    process gone, its L1 with it); the pass after hits at least 95% of what the
    second pass hit, all of it out of L2, verified — where L2 lived in the
    process, nothing."""
    config = small_config("cache.host_tokens=384")
    f = LocalFabric(config, l2_dir=tmp_path if shared else None)
    prompts = [pack_tokens(prompt(seed, pages=3, shared=1)) for seed in range(10)]
    first_pass(f, prompts)
    before, _ = hit_tokens(f, prompts)
    assert before > 0
    f.restart_rank(2)
    f.step()  # the new incarnation is seen: reset, then adoption
    adopted = f.core.stats.adopted_tokens
    after, from_l2 = hit_tokens(f, prompts)
    # L1 starts empty after the reset: every hit of this pass came out of L2 (a
    # shared page loaded back once is then an L1 hit for the prompts after it).
    if shared:
        assert after >= 0.95 * before, (after, before)
        assert adopted >= from_l2 > 0 and f.ranks[2].l2_kept > 0
    else:  # a cold pass: only the pages it computes itself hit, none from L2
        assert adopted == 0 and from_l2 == 0 and after < 0.5 * before
    f.core.cache.check_integrity()
    f.close()
    assert list(tmp_path.glob("*.l2")) == [], "closing the fabric removes its L2 files"


def test_a_slot_being_written_when_the_rank_died_is_not_adopted(tmp_path):
    """Killed between clearing a slot's name and the end of its copy: that slot
    has no name on the restarted rank, so no rank's copy of it is adopted."""
    f = LocalFabric(small_config("cache.host_tokens=384"), l2_dir=tmp_path)
    prompts = [pack_tokens(prompt(seed, pages=3)) for seed in range(4)]
    first_pass(f, prompts)
    named = dict(f.ranks[1].names.host)
    victim = next(iter(named))
    f.ranks[1].names.forget_host([victim])  # the copy into it had begun
    f.restart_rank(1)
    assert victim not in f.ranks[1].names.host and len(f.ranks[1].names.host) == len(named) - 1
    f.step()
    assert f.core.stats.adopted_tokens > 0
    adopted = {
        p for n in f.core.cache.tree.walk() if n.host_value is not None for p in n.host_value
    }
    assert adopted and victim not in adopted, "no rank's copy of that slot is taken back"
    _, from_l2 = hit_tokens(f, prompts)
    assert from_l2 > 0
    f.core.cache.check_integrity()
    f.close()


def test_the_l2_pool_is_a_view_of_the_file(tmp_path):
    f = LocalFabric(small_config(), l2_dir=tmp_path)
    rank = f.ranks[0]
    rank.pools["full"].host.buffer.view(-1)[0] = 3.0
    at = rank.shared_l2.pool_at
    on_file = (tmp_path / "rank-0.l2").read_bytes()[
        at : at + rank.pools["full"].host.buffer.element_size()
    ]
    assert (
        on_file == rank.pools["full"].host.buffer.view(-1)[:1].view(torch.uint8).numpy().tobytes()
    )
    f.close()


def test_too_little_shared_memory_keeps_l2_in_the_process(tmp_path, monkeypatch, caplog):
    import errno

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    f = LocalFabric(small_config(), l2_dir=tmp_path)
    assert all(r.shared_l2 is None for r in f.ranks)
    assert "L2 in this process" in caplog.text and list(tmp_path.iterdir()) == []
    tokens = pack_tokens(prompt(1, pages=2))
    r = f.serve(tokens)
    assert r.error is None and f.verify(r, tokens) == [True] * 4
    f.close()


# -- trust: the file's owner and mode, and every page's checksum ---------------------


def test_a_file_others_could_write_is_repaired_and_started_empty(tmp_path, caplog):
    path = tmp_path / "rank-0.l2"
    store = SharedL2(path, GEOMETRY, slots=2, token_bytes=TB)
    store.put(0, "a", b"\2" * 32, bytes(TB))
    store.close()
    os.chmod(path, 0o666)
    with caplog.at_level("WARNING", "fabric.rank.shared_l2"):
        again = SharedL2(path, GEOMETRY, slots=2, token_bytes=TB)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert not again.reattached and again.names() == {}
    assert "repaired to 0600 and started empty" in caplog.text
    again.close(unlink=True)


def test_a_file_of_another_owner_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "rank-0.l2"
    SharedL2(path, GEOMETRY, slots=1, token_bytes=TB).close()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(OSError, match="not a regular file of this user"):
        SharedL2(path, GEOMETRY, slots=1, token_bytes=TB)


def test_a_page_changed_after_it_was_named_is_not_adopted_and_is_found_by_checks(tmp_path):
    path = tmp_path / "rank-0.l2"
    store = SharedL2(path, GEOMETRY, slots=4, token_bytes=TB)
    for slot in range(4):
        store.pool[slot * 16 : slot * 16 + 16] = bytes([slot + 1]) * 16
        store.put(slot, "a", bytes([slot]) * 32, bytes(TB))
    store.pool[2 * 16 + 5] ^= 0x01  # another process of the node flips one bit of page 2
    assert store.check([0, 1, 3]) == [] and store.check([2]) == [2]
    assert store.check([2], every=1000) == [2], "once found, always refused until rewritten"
    store.close()
    again = SharedL2(path, GEOMETRY, slots=4, token_bytes=TB)
    assert set(again.names()) == {0, 1, 3} and again.corrupt_pages == 1
    again.pool[2 * 16 : 3 * 16] = b"\x09" * 16
    again.put(2, "a", b"\2" * 32, bytes(TB))  # written and named anew: whole again
    assert again.check([2]) == [] and set(again.names()) == {0, 1, 2, 3}
    again.close(unlink=True)


def test_checks_of_loads_take_a_sample(tmp_path):
    store = SharedL2(tmp_path / "rank-0.l2", GEOMETRY, slots=4, token_bytes=TB)
    for slot in range(4):
        store.put(slot, "a", bytes([slot]) * 32, bytes(TB))
    for slot in range(4):
        store.pool[slot * 16] ^= 0xFF  # every page corrupt
    found = [store.check([slot], every=4) for slot in range(4)]
    assert sum(bool(f) for f in found) == 1, "one page in four is checked"
    assert sorted(set(store.check([0, 1, 2, 3], every=1))) == [0, 1, 2, 3]
    store.close(unlink=True)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_pages_checksum_covers_exactly_its_bytes_in_each_layout(tmp_path, layout):
    """A page's bytes are its K and V of every layer wherever the layout puts
    them: a change to any of them changes its checksum, a change elsewhere not."""
    from fabric.rank.shared_l2 import _page_spans

    pages, tokens, layers, heads, dim = 3, 2, 2, 1, 2
    shape = {
        "layer_first": (2, layers, pages * tokens, heads, dim),
        "page_first": (2, pages * tokens, layers, heads, dim),
        "page_first_direct": (2, pages, layers, tokens, heads, dim),
    }[layout]
    pool = torch.zeros(shape, dtype=torch.float16)
    view = {  # (2, pages, page tokens, layers, heads, dim), as KVPool views it
        "layer_first": lambda: pool.view(2, layers, pages, tokens, heads, dim).permute(
            0, 2, 3, 1, 4, 5
        ),
        "page_first": lambda: pool.view(2, pages, tokens, layers, heads, dim),
        "page_first_direct": lambda: pool.permute(0, 1, 3, 2, 4, 5),
    }[layout]()
    geometry = {"shape": list(shape), "pool_bytes": pool.numel() * 2, "layout": layout}
    spans = _page_spans(geometry, pages)
    raw = pool.view(-1).view(torch.uint8)
    for page in range(pages):
        covered = torch.zeros(raw.numel(), dtype=torch.bool)
        for offset, length in spans(page):
            covered[offset : offset + length] = True
        pool.zero_()
        view[:, page] = 1.0
        assert torch.equal(raw != 0, covered & (raw != 0)) and int(covered.sum()) == (
            2 * tokens * layers * heads * dim * 2
        ), "the spans are exactly the page's bytes"


@pytest.fixture
def check_every_page(monkeypatch):
    import fabric.rank.worker as worker

    monkeypatch.setattr(worker, "L2_CHECK_EVERY", 1)  # as the worker reads it


def test_a_corrupt_l2_page_is_never_served_the_fabric_recomputes(tmp_path, check_every_page):
    """Every named L2 page of rank 0 is changed behind it; the next pass that would
    load them from L2 fails those loads (the coordinator resets and recomputes)
    and every answer is still right."""
    f = LocalFabric(small_config("cache.host_tokens=384"), l2_dir=tmp_path)
    prompts = [pack_tokens(prompt(seed, pages=3)) for seed in range(20)]  # more than L1 holds
    first_pass(f, prompts)
    rank = f.ranks[0]
    slots = list(rank.names.host)
    assert slots
    rows = rank.pools["full"].host.pages  # (2, pages, page tokens, layers, heads, dim)
    for slot in slots:
        rows[:, slot] += 1.0
    for tokens in prompts:
        r = f.serve(tokens)
        assert r.error is None and f.verify(r, tokens) == [True] * 4
        f.core.release(r.lease)
    assert rank.shared_l2.corrupt_pages > 0
    assert f.core.stats.resets >= 1, "the failed loads reset L1/L2: recomputed"
    f.core.cache.check_integrity()
    f.close()
