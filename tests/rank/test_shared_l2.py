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
