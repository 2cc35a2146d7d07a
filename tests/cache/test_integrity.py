"""The integrity check, one invariant at a time: each corruption of a sound cache is
found by the check for that invariant, and ``check_integrity`` names it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fabric.cache import integrity
from fabric.cache.hicache import HiCache
from fabric.errors import IntegrityError
from tests.helpers import make_cache, put, toks


def _sound_cache() -> HiCache:
    """Two prompts sharing a page, one leaf moved to L2: every tier has nodes."""
    cache = make_cache(device_pages=8, host_pages=16, immediate=True)
    put(cache, toks(1, 2, 3))
    put(cache, toks(1, 4))
    cache.check_integrity()
    return cache


def _leaf(cache: HiCache):
    return next(n for n in cache.tree.walk() if not n.children)


def _uncount_children(c: HiCache) -> None:
    c.tree.root.device_children += 1


def _shorten_value(c: HiCache) -> None:
    leaf = _leaf(c)
    leaf.device_value = leaf.device_value[:-1]


def _miscount_evictable(c: HiCache) -> None:
    c.tree.evictable_size += 1


def _list_an_inner_node(c: HiCache) -> None:
    c.tree.device_leaves.members.add(next(n for n in c.tree.walk() if n.children))


def _miscount_pins(c: HiCache) -> None:
    c.pins.pinned_size += 4


def _extra_host_ref(c: HiCache) -> None:
    _leaf(c).host_ref += 1


def _lease_an_owned_page(c: HiCache) -> None:
    c.placement.leased.add(_leaf(c).device_value[0])


def _lock_a_host_only_node(c: HiCache) -> None:
    leaf = _leaf(c)
    leaf.host_value = leaf.device_value
    leaf.device_value = None
    leaf.lock_ref = 1


CORRUPTIONS: list[tuple[Callable[[HiCache], None], Callable, str]] = [
    (_uncount_children, integrity.links, "device_children="),
    (_shorten_value, integrity.values, "device value has"),
    (_miscount_evictable, integrity.l1_counters, "L1 counters"),
    (_list_an_inner_node, integrity.leaf_sets, "device leaf set differs"),
    (_miscount_pins, integrity.pins, "pinned_size="),
    (_extra_host_ref, integrity.host_refs, "host_ref="),
    (_lease_an_owned_page, integrity.pages_owned_once, "owned twice"),
    (_lock_a_host_only_node, integrity.prefix_closed, "locked but not on device"),
]


@pytest.mark.parametrize(
    ("corrupt", "check", "message"), CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS]
)
def test_each_corruption_is_found_by_its_own_check(corrupt, check, message):
    cache = _sound_cache()
    assert list(check(cache, cache.tree.walk())) == []
    corrupt(cache)
    found = list(check(cache, cache.tree.walk()))
    assert any(message in v for v in found), found
    with pytest.raises(IntegrityError, match=message):
        cache.check_integrity()


def test_every_check_runs_and_a_sound_cache_passes_them_all():
    cache = _sound_cache()
    assert {check for _, check, _ in CORRUPTIONS} <= set(integrity.CHECKS)
    for check in integrity.CHECKS:
        assert list(check(cache, cache.tree.walk())) == [], check.__name__
