"""A hybrid model's components in the tree: a prefix is served only where every
component can serve it; components are evicted apart, leaving tombstones; dead
leaves go; locks protect only what a match end needs; integrity per component."""

from __future__ import annotations

import pytest

from fabric.cache.admission import Admission
from fabric.cache.keys import pack_tokens
from fabric.config import FabricConfig, ModelConfig
from fabric.errors import ConfigError
from tests.helpers import P, hybrid_model, make_cache, toks


def serve(adm: Admission, *pages: int):
    """One request for ``pages`` (whole pages), filled and released; returns its
    device hit in tokens and its fill."""
    req = adm.begin(pack_tokens(toks(*pages)))
    fill = adm.prefill(req, req.num_tokens)
    assert fill is not None
    hit = req.device_hit
    adm.release(req)
    adm.cache.check_integrity()
    return hit, fill


def hybrid(kinds: str, **options):
    options = {"device_pages": 32, "host_pages": 64, **options}
    cache = make_cache(model=hybrid_model(kinds), **options)
    return cache, Admission(cache)


def test_mamba_prefix_is_served_only_where_a_state_was_stored():
    cache, adm = hybrid("mamba")
    hit, fill = serve(adm, 1, 2, 3)
    assert hit == 0 and fill.parts is not None and fill.parts.mamba_at == [3]
    assert serve(adm, 1, 2, 3)[0] == 3 * P  # a state at the end of 1, 2, 3
    # 1, 2 is cached for full attention, but no state was stored after page 2.
    hit, fill = serve(adm, 1, 2, 7)
    assert hit == 0 and cache.parts.stats.truncated_matches == 1
    # The fill recomputed pages 1 and 2 into the tree's own pages (nothing leaked)
    # and stored a state where the tree now branches, and one at its own end.
    assert len(fill.pages) == 3 and fill.parts.mamba_at == [2, 3]
    assert serve(adm, 1, 2, 3)[0] == 3 * P
    assert serve(adm, 1, 2, 9)[0] == 2 * P  # served at the branch point
    assert serve(adm, 1, 2)[0] == 2 * P
    assert cache.component_sizes()["mamba"].evictable == 4


def test_sliding_prefix_needs_the_window_before_its_end():
    cache, adm = hybrid("sliding")  # window 6 tokens: 5 before a position, 2 pages
    assert cache.parts.window_pages == 2
    hit, fill = serve(adm, 1, 2, 3, 4, 5, 6)
    assert sorted(fill.parts.sliding_at) == [4, 5]  # only the last two pages' KV kept
    assert serve(adm, 1, 2, 3, 4, 5, 6)[0] == 6 * P
    # Ending at page 3: KV of pages 2 and 3 was never kept.
    hit, fill = serve(adm, 1, 2, 3, 8)
    assert hit == 0
    # The fill kept the window before the branch point and before its own end.
    assert sorted(fill.parts.sliding_at) == [1, 2, 3]
    assert serve(adm, 1, 2, 3, 9)[0] == 3 * P
    # The long prompt still hits through the split: its own tail covers its window.
    assert serve(adm, 1, 2, 3, 4, 5, 6)[0] == 6 * P
    # A prefix ending inside a node, where no fill computed through: not served.
    assert serve(adm, 1, 2, 3, 4, 5, 7)[0] == 3 * P


def test_a_short_leaf_takes_part_of_its_window_from_its_parent():
    cache, adm = hybrid("sliding")
    serve(adm, 1, 2, 3)
    hit, fill = serve(adm, 1, 2, 3, 4)
    assert hit == 3 * P and fill.parts.sliding_at == [3]  # page 2 came from the parent
    assert serve(adm, 1, 2, 3, 4)[0] == 4 * P
    # Evicting the parent's tail breaks the leaf's window: no longer served.
    parent = cache.tree.root.children[("default", pack_tokens(toks(1)))]
    assert parent.sliding is not None
    cache.parts._evict_tail(parent)
    cache.check_integrity()
    assert serve(adm, 1, 2, 3, 4)[0] == 0


def test_component_eviction_leaves_tombstones_and_removes_dead_leaves():
    cache, adm = hybrid("mamba", mamba_states=2)
    serve(adm, 1, 2)
    serve(adm, 3, 4)
    serve(adm, 5, 6)  # no third state: the oldest (1, 2) loses its state
    assert cache.parts.stats.mamba_evicted_states == 1
    # Its leaf could serve nothing: removed (deleted: no step wrote it to L2).
    assert cache.parts.stats.tombstones_removed == 1
    assert ("default", pack_tokens(toks(1))) not in cache.tree.root.children
    assert serve(adm, 1, 2)[0] == 0


def test_a_dead_leaf_backed_up_in_l2_is_demoted_not_deleted():
    cache, adm = hybrid("mamba", mamba_states=1, immediate=True)
    serve(adm, 1, 2)
    cache.poll()  # a step: the write-through to L2 queued and completed
    serve(adm, 3, 4)
    first = cache.tree.root.children[("default", pack_tokens(toks(1)))]
    assert first.device_value is None and first.host_value is not None and first.mamba is None
    cache.check_integrity()
    assert serve(adm, 3, 4)[0] in (0, 2 * P)  # maybe evicted by the refill, never wrong
    cache.check_integrity()


def test_an_interior_tombstone_keeps_serving_longer_prefixes():
    cache, adm = hybrid("mamba", mamba_states=3)
    serve(adm, 1, 2)
    serve(adm, 1, 2, 3)  # states at 1,2 and at 1,2,3
    node = cache.tree.root.children[("default", pack_tokens(toks(1)))]
    assert node.mamba is not None and node.children
    cache.parts._evict_state(node)
    cache.parts.prune(node)  # interior: it stays, a tombstone
    cache.check_integrity()
    assert node.device_value is not None and node.mamba is None
    assert serve(adm, 1, 2, 3)[0] == 3 * P
    assert serve(adm, 1, 2, 9)[0] == 0


def test_a_lock_protects_the_state_at_its_end_and_only_the_window_before_it():
    cache, adm = hybrid("both", mamba_states=4)
    serve(adm, 1, 2, 3, 4, 5)
    serve(adm, 1, 2, 3, 4, 5, 6, 7, 8)  # its window: pages 6 and 7 (0-based)
    long_key = cache.key(toks(1, 2, 3, 4, 5, 6, 7, 8))
    m = cache.placement.match_prefix(long_key)
    assert m.device_tokens == 8 * P
    cache.placement.inc_lock_ref(m.last_device_node)
    end = m.last_device_node
    upper = end.parent
    assert end.sliding_locks and end.part_ref == 1
    assert not upper.sliding_locks and upper.part_ref == 0  # outside the window
    freed = cache.parts.evict_mamba(4) + cache.parts.evict_sliding(100)
    assert freed > 0
    assert end.mamba is not None and end.sliding is not None  # locked: kept
    assert upper.mamba is None and upper.sliding is None  # not needed by the lock: gone
    assert cache.parts.valid_end(end, cache.tree.pages)
    cache.check_integrity()
    cache.placement.dec_lock_ref(end)
    cache.check_integrity()
    assert cache.component_sizes()["sliding"].protected == 0


def test_a_split_divides_the_sliding_locks_exactly():
    cache, adm = hybrid("sliding", device_pages=64)  # window 2 pages
    serve(adm, 1, 2, 3, 4)
    m = cache.placement.match_prefix(cache.key(toks(1, 2, 3, 4)))
    cache.placement.inc_lock_ref(m.last_device_node)
    node = m.last_device_node
    cache.placement.match_prefix(cache.key(toks(1, 2, 3, 9)))  # splits the locked node after page 3
    assert node.sliding_locks == {2: 1} and node.parent.sliding_locks == {1: 1}
    cache.check_integrity()
    cache.placement.dec_lock_ref(node)
    assert node.sliding_locks is None and node.parent.sliding_locks is None
    cache.check_integrity()


def test_sizes_per_component_add_up_and_a_reset_empties_them():
    cache, adm = hybrid("both")
    for first in range(1, 6):
        serve(adm, first, 2, 3)
    sizes = cache.component_sizes()
    for name, s in sizes.items():
        assert s.free + s.evictable + s.protected == s.capacity, name
        assert s.evictable > 0 and s.protected == 0, name
    cache.reset()
    cache.check_integrity()
    assert all(s.free == s.capacity for s in cache.component_sizes().values())


def test_full_attention_models_have_no_components():
    cache = make_cache(model=ModelConfig())
    assert cache.parts is None and cache.component_sizes() == {}
    assert ModelConfig(layers=2, layer_kinds=["full", "full"]).components == ("full",)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.layer_kinds=[full, attention, full, full]"], "'attention'"),
        (["model.layer_kinds=[full, sliding]"], "one per layer"),
        (["model.layer_kinds=[mamba, mamba, mamba, mamba]"], "no full layer"),
        (["model.layer_kinds=[full, sliding, full, full]"], "model.sliding_window=0"),
        (["cache.sliding_tokens=5"], "cache.sliding_tokens=5"),
        (
            ["model.layer_kinds=[full, full, full, full]", "model.filler=hybrid"],
            "full attention only",
        ),
        (
            [
                "model.layer_kinds=[full, sliding, full, full]",
                "model.sliding_window=4",
                "model.filler=llama",
            ],
            "'llama'",
        ),
        (
            [
                "model.layer_kinds=[full, sliding, mamba, full]",
                "model.sliding_window=4",
                "model.filler=hybrid",
            ],
            "sliding and mamba layers together",
        ),
    ],
)
def test_bad_hybrid_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        FabricConfig().with_overrides(overrides)


def test_components_go_to_l2_with_their_pages_and_come_back_with_a_load():
    cache, adm = hybrid("both", immediate=True, mamba_states=8)
    serve(adm, 1, 2, 3)
    cache.poll()  # write-through: the pages and their components to L2
    node = cache.tree.root.children[("default", pack_tokens(toks(1)))]
    assert node.host_value is not None and node.host_mamba is not None
    assert node.host_sliding is not None and len(node.host_sliding) == len(node.sliding)
    cache.device_evictions.evict(
        1 << 20
    )  # every unlocked leaf demoted: components leave L1, stay in L2
    assert node.device_value is None and node.sliding is None and node.mamba is None
    cache.check_integrity()
    # Served from L2: the load brings the components back with the pages.
    key = cache.key(toks(1, 2, 3))
    m = cache.placement.match_prefix(key)
    assert m.device_tokens == 0 and m.host_tokens == 3 * P
    req = adm.begin(pack_tokens(toks(1, 2, 3, 4)))
    fill = adm.prefill(req, req.num_tokens)
    assert req.host_hit == 3 * P and fill.start == 3 * P
    assert node.sliding is not None and node.mamba is not None
    adm.release(req)
    cache.check_integrity()
    # An L2 node deleted takes its components with it.
    cache.poll()  # the load completes: its lock goes
    cache.device_evictions.evict(1 << 20)
    cache.host_evictions.evict(1 << 20)
    cache.check_integrity()
    assert all(s.free == s.capacity for s in cache.component_sizes().values())
    assert cache.parts.host_mamba_pool.available_pages == cache.parts.host_mamba_pool.num_pages


def node_of(cache, *pages: int):
    """The node whose key ends after ``pages`` (whole pages from the root)."""
    node, data = cache.tree.root, pack_tokens(toks(*pages))
    while data:
        child = node.children[("default", data[: cache.tree.page_bytes])]
        data = data[len(child.key) :]
        node = child
    return node


def test_an_l2_only_component_is_in_its_l2_queue_and_nowhere_else():
    cache, adm = hybrid("both", immediate=True)
    serve(adm, 1, 2, 3)
    cache.poll()
    node = node_of(cache, 1, 2, 3)
    parts = cache.parts
    # In L1 and L2: in L1's queues only.
    assert node.host_mamba is not None and node in parts.mamba_lru
    assert node not in parts.host_mamba_lru and node not in parts.host_sliding_lru
    parts._evict_state(node)  # L1's state evicted alone: L2's is the only one
    assert node in parts.host_mamba_lru and node not in parts.mamba_lru
    cache.check_integrity()
    cache.device_evictions.evict(1 << 20)  # demoted: every L2 value is L2-only
    assert node in parts.host_sliding_lru and node in parts.host_mamba_lru
    cache.check_integrity()
    req = adm.begin(pack_tokens(toks(1, 2, 3, 4)))  # loaded back: in L1 again
    adm.prefill(req, req.num_tokens)
    assert req.host_hit == 3 * P and node.mamba is not None
    assert node not in parts.host_mamba_lru and node not in parts.host_sliding_lru
    adm.release(req)
    cache.check_integrity()


def test_integrity_names_an_l2_only_component_missing_from_its_queue():
    cache, adm = hybrid("mamba", immediate=True)
    serve(adm, 1, 2)
    cache.poll()
    cache.device_evictions.evict(1 << 20)
    node = node_of(cache, 1, 2)
    cache.parts.host_mamba_lru.discard(node)
    with pytest.raises(AssertionError, match="L2 mamba queue membership is False"):
        cache.check_integrity()


@pytest.mark.parametrize("kinds", ["mamba", "sliding"])
def test_a_component_short_of_l2_evicts_its_own_l2_only_values_in_lru_order(kinds):
    # L2 has room for every prompt's pages, its component pool for two prompts'.
    room = {"host_mamba_states": 2} if kinds == "mamba" else {"host_sliding_tokens": 4 * P}
    cache, adm = hybrid(kinds, immediate=True, **room)
    parts = cache.parts
    for first in (1, 2):
        serve(adm, first, 10 + first)
        cache.poll()
    cache.device_evictions.evict(1 << 20)  # both L2-only now, 1 the older
    old, newer = node_of(cache, 1, 11), node_of(cache, 2, 12)
    serve(adm, 3, 13)
    cache.poll()  # its write needs a slot: the oldest L2-only value goes
    new = node_of(cache, 3, 13)
    cache.check_integrity()
    if kinds == "mamba":
        assert old.host_mamba is None and newer.host_mamba is not None
        assert new.host_mamba is not None and parts.stats.host_mamba_evicted_states == 1
    else:
        assert old.host_sliding is None and newer.host_sliding is not None
        assert new.host_sliding is not None and parts.stats.host_sliding_evicted_pages == 2
    # Only the component left L2: the full pages stay, and serve longer prompts
    # through the L2 tombstone, not as an end.
    assert old.host_value is not None and old in cache.tree.host_leaves
    m = cache.placement.match_prefix(cache.key(toks(1, 11)))
    assert m.device_tokens == 0 and m.host_tokens == 0


def test_protected_l2_components_are_not_evicted():
    cache, adm = hybrid("mamba", immediate=True, host_mamba_states=1, pin_budget_fraction=0.5)
    serve(adm, 1, 2)
    cache.poll()
    cache.device_evictions.evict(1 << 20)
    held = node_of(cache, 1, 2)
    assert cache.pin_prefix(cache.key(toks(1, 2)), 60).pinned_tokens == 2 * P
    assert held.host_ref and cache.parts.evict_host("mamba", 1) == 0
    serve(adm, 3, 4)
    cache.poll()  # no slot for the new node's state in L2: it stays out of L2
    assert held.host_mamba is not None and node_of(cache, 3, 4).host_mamba is None
    assert cache.pins.unpin(cache.key(toks(1, 2))) == 2 * P
    assert cache.parts.evict_host("mamba", 1) == 1 and held.host_mamba is None
    cache.check_integrity()
    with pytest.raises(ValueError, match="component 'full' is refused"):
        cache.parts.evict_host("full", 1)


def test_l2_component_eviction_spares_the_path_being_written():
    # Window of two pages: a one-page leaf's window reaches into its parent's tail.
    # Under write-back, L2 gets a node only when asked.
    cache, adm = hybrid(
        "sliding", immediate=True, host_sliding_tokens=2 * P, write_policy="write_back"
    )
    serve(adm, 1, 2)
    parent = node_of(cache, 1, 2)
    assert cache.writes.write_backup(parent) == 2 * P
    cache.poll()
    serve(adm, 1, 2, 3)
    child = node_of(cache, 1, 2, 3)
    cache.parts._evict_tail(parent)  # the parent's tail is in L2 only: evictable there
    assert parent in cache.parts.host_sliding_lru and child.host_value is None
    assert cache.writes.write_backup(child) == P  # its tail finds L2's pool full
    cache.poll()
    cache.check_integrity()
    # The parent's tail is part of the child's window: not evicted for it.
    assert parent.host_sliding is not None and child.host_sliding is None
    assert cache.parts.evict_host("sliding", 1) == 2  # unprotected otherwise


def test_checkpoints_keep_states_inside_long_prefixes_and_matches_use_the_nearest():
    cache, adm = hybrid("mamba", mamba_checkpoint_tokens=2 * P)
    hit, fill = serve(adm, *range(1, 8))  # seven pages: checkpoints after 2, 4 and 6
    assert hit == 0 and fill.parts.mamba_at == [2, 4, 6, 7]
    assert cache.parts.stats.checkpoints_saved == 3
    assert serve(adm, *range(1, 8))[0] == 7 * P
    # Branching after page 5: served up to the checkpoint after page 4.
    hit, fill = serve(adm, 1, 2, 3, 4, 5, 20)
    assert hit == 4 * P and fill.parts.mamba_at == [5, 6]
    assert serve(adm, 1, 2, 3)[0] == 2 * P
    # Without checkpoints the same branch finds no state inside the long node.
    cache, adm = hybrid("mamba")
    serve(adm, *range(1, 8))
    assert serve(adm, 1, 2, 3, 4, 5, 20)[0] == 0


def test_checkpoints_take_free_state_slots_only():
    cache, adm = hybrid("mamba", mamba_states=3, mamba_checkpoint_tokens=P)
    serve(adm, 30)
    serve(adm, 31)  # two states cached; one slot free
    _hit, fill = serve(adm, 1, 2, 3, 4)  # checkpoints after 1, 2, 3; its end after 4
    stats = cache.parts.stats
    # The shallowest checkpoint got the free slot; the end evicted for its own.
    assert fill.parts.mamba_at == [1, 4]
    assert stats.checkpoints_saved == 1 and stats.checkpoints_skipped == 2
    assert stats.mamba_evicted_states == 1 and stats.mamba_alloc_failures == 0
    assert serve(adm, 1, 2, 9)[0] == P  # served from the checkpoint after page 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "model.layer_kinds=[full, sliding]",
                "model.sliding_window=4",
                "cache.mamba_checkpoint_tokens=32",
            ],
            "cache.mamba_checkpoint_tokens=32 is refused for a model without mamba layers",
        ),
        (
            ["model.layer_kinds=[full, mamba]", "cache.mamba_checkpoint_tokens=20"],
            "cache.mamba_checkpoint_tokens=20 is refused",
        ),
    ],
)
def test_bad_checkpoint_intervals_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        FabricConfig().with_overrides(["model.layers=2", *overrides])
