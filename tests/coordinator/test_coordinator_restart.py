"""A coordinator's death loses no cached KV: a new coordinator takes back the L2
pages every rank still holds (``CoordinatorCore.adopt``), serves them as L2 hits,
and adopts nothing that any rank lacks, holds as something else, or names
wrongly — every served page is verified on every rank."""

from __future__ import annotations

import pytest

from fabric.cache.adopt import adopt_host, common_pages
from fabric.cache.keys import pack_tokens
from fabric.coordinator.figures import figures
from fabric.driver.local import LocalFabric
from fabric.errors import InvalidInput
from fabric.rank.index import PageIndex, PageName
from tests.helpers import prompt, small_config, storage_options


def cached(f: LocalFabric, *prompts: bytes) -> None:
    for p in prompts:
        r = f.serve(p)
        assert f.core.release(r.lease)
    f.settle()  # written through to L2 on every rank


def serve_verified(f: LocalFabric, p: bytes):
    r = f.serve(p)
    assert r.error is None and f.verify(r, p) == [True] * 4
    f.core.cache.check_integrity()
    return r


def test_a_restarted_coordinator_serves_what_l2_held_as_l2_hits():
    f = LocalFabric(small_config())
    a, b = pack_tokens(prompt(1, pages=6, shared=2)), pack_tokens(prompt(2, pages=5, shared=2))
    cached(f, a, b)
    f.restart_coordinator()
    assert f.core.stats.adopted_tokens == (6 + 5 - 2) * 4  # the shared pages once
    f.core.cache.check_integrity()
    r = serve_verified(f, a)
    assert r.host_hit_tokens == 24 and r.computed_tokens == 0
    r = serve_verified(f, pack_tokens(prompt(3, pages=4, shared=2)))
    assert r.device_hit_tokens == 8, "the shared prefix is a node of its own (loaded with a)"
    assert figures(f.core).counters.adopted_tokens == 36


def test_a_restarted_coordinator_hits_l2_not_l3(tmp_path):
    f = LocalFabric(small_config(*storage_options(tmp_path)))
    a = pack_tokens(prompt(4, pages=6))
    cached(f, a)
    f.restart_coordinator()
    r = serve_verified(f, a)
    assert r.host_hit_tokens == 24 and r.storage_hit_tokens == 0


@pytest.mark.parametrize("how", ["lost", "other page", "wrong name"])
def test_a_page_one_rank_does_not_hold_as_named_is_not_adopted_nor_what_follows(how):
    f = LocalFabric(small_config())
    a = pack_tokens(prompt(5, pages=6))
    cached(f, a)
    # Rank 2's L2 slot of page 3 of the prompt: lost, holding another page, or
    # named with tokens that do not hash to its name on every rank.
    names = f.ranks[2].names.host
    slot = next(s for s, n in names.items() if n.tokens == a[12 * 4 : 16 * 4])
    if how == "lost":
        del names[slot]
    elif how == "other page":
        names[slot] = names[next(s for s in names if s != slot)]
    else:
        for rank in f.ranks:
            n = rank.names.host[slot]
            rank.names.host[slot] = PageName(n.namespace, n.chain_hash, n.parent_hash, b"\0" * 16)
    f.restart_coordinator()
    assert f.core.stats.adopted_tokens == 12, "pages 0-2 only: the chain breaks at page 3"
    r = serve_verified(f, a)
    assert r.host_hit_tokens == 12 and r.computed_tokens == 12


def test_a_write_in_flight_when_the_coordinator_died_is_not_adopted():
    f = LocalFabric(small_config())
    a = pack_tokens(prompt(6, pages=4))
    f.core.submit(a)
    # The compute and its write-through go out; rank 1 has not run them when
    # the coordinator dies, and the new one's epoch drops them from its queue.
    f.step(lagging={1})
    assert f.ranks[0].names.host and not f.ranks[1].names.host
    f.restart_coordinator()
    assert f.core.stats.adopted_tokens == 0
    r = serve_verified(f, a)
    assert r.host_hit_tokens == 0 and r.computed_tokens == 16


def test_a_failed_write_names_nothing():
    f = LocalFabric(small_config())
    f.ranks[3].faults.fail_writes = True
    a = pack_tokens(prompt(11, pages=4))
    cached(f, a)
    f.ranks[3].faults.fail_writes = False
    f.restart_coordinator()
    assert f.core.stats.adopted_tokens == 0
    serve_verified(f, a)


def test_an_l2_slot_written_again_names_its_new_page():
    # L2 of 12 pages: the second prompt's write-through evicts the first from L2
    # and reuses its slots; after a restart only what the slots hold now is adopted.
    f = LocalFabric(small_config("cache.host_tokens=48"))
    a, b = pack_tokens(prompt(7, pages=8)), pack_tokens(prompt(8, pages=8))
    cached(f, a)
    cached(f, b)
    f.restart_coordinator()
    adopted = f.core.stats.adopted_tokens
    assert 0 < adopted <= 48
    for p in (a, b):
        serve_verified(f, p)


def test_a_hybrid_model_adopts_pages_that_serve_nothing_alone():
    f = LocalFabric(
        small_config(
            "model.layer_kinds=[full, mamba]", "cache.mamba_states=8", "cache.sliding_tokens=16"
        )
    )
    a = pack_tokens(prompt(9, pages=5))
    cached(f, a)
    f.restart_coordinator()
    assert f.core.stats.adopted_tokens == 20
    r = serve_verified(f, a)  # no state was adopted: the prefix is computed again
    assert r.host_hit_tokens == 0 and r.computed_tokens == 20


def test_common_pages_keeps_what_every_rank_names_alike():
    e = (3, "ns", b"h" * 32, b"p" * 32, b"t" * 16)
    other = (3, "ns", b"x" * 32, b"p" * 32, b"t" * 16)
    assert common_pages([[e], [e]]) == [e]
    assert common_pages([[e], [other]]) == []
    assert common_pages([[e], []]) == []
    assert common_pages([]) == []


def test_adopting_into_a_tree_that_holds_anything_is_refused():
    f = LocalFabric(small_config())
    cached(f, pack_tokens(prompt(10, pages=2)))
    with pytest.raises(InvalidInput, match="empty tree"):
        adopt_host(f.core.cache, [])


def test_a_page_index_names_only_whole_pages_and_forgets_before_a_write():
    idx = PageIndex(page_size=2)
    tokens = pack_tokens([1, 2, 3, 4, 5])
    idx.computed("ns", b"s" * 32, tokens, [7, 8, 9])
    assert sorted(idx.device) == [7, 8], "the partial third page has no name"
    assert idx.device[8].parent_hash == idx.device[7].chain_hash
    idx.copied(idx.device, [7, 9], idx.host, [0, 1])
    assert sorted(idx.host) == [0]
    assert idx.entries()[0][:2] == (0, "ns")


def test_pages_prefetched_from_l3_are_adopted_too(tmp_path):
    a = pack_tokens(prompt(12, pages=6))
    cached(LocalFabric(small_config(*storage_options(tmp_path))), a)  # fills L3
    f = LocalFabric(small_config(*storage_options(tmp_path), "prefetch.threshold_tokens=4"))
    r = f.serve(a)
    assert r.storage_hit_tokens == 24
    f.core.release(r.lease)
    f.settle()
    f.restart_coordinator()
    assert f.core.stats.adopted_tokens == 24, "the prefetch named its pages on every rank"
    r = serve_verified(f, a)
    assert r.host_hit_tokens == 24 and r.storage_hit_tokens == 0
