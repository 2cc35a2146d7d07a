"""Caller mistakes get a clear error and leave nothing half-applied."""

import pytest

from fabric.cache.keys import TokenKey
from fabric.errors import InvalidInput
from tests.helpers import P, make_cache, put, toks


def snapshot(c):
    return (
        sorted((n.id, n.device_value, n.host_value, n.lock_ref) for n in c.tree.walk()),
        c.ctl.device.available_pages,
        c.ctl.host.available_pages,
        sorted(c.placement.leased),
    )


@pytest.fixture
def cache():
    c = make_cache()
    put(c, toks(1, 2))
    c.writes.complete(1)
    return c


def refused(c, call, match):
    before = snapshot(c)
    with pytest.raises(InvalidInput, match=match):
        call()
    assert snapshot(c) == before
    c.check_integrity()


def test_insert_length_mismatch(cache):
    pages = cache.placement.alloc_device(P)
    refused(cache, lambda: cache.placement.insert(cache.key(toks(3, 4)), pages), "lengths differ")


def test_insert_with_pages_not_leased(cache):
    refused(cache, lambda: cache.placement.insert(cache.key(toks(1, 2, 3)), (0, 1, 7)), r"\[7\]")
    pages = cache.placement.alloc_device(P)
    refused(cache, lambda: cache.placement.insert(cache.key(toks(5, 6)), pages * 2), "repeated")


def test_unaligned_or_negative_allocation(cache):
    refused(cache, lambda: cache.placement.alloc_device(P + 1), "multiple of page_size")
    refused(cache, lambda: cache.placement.alloc_device(-P), "multiple of page_size")


def test_double_free_of_leased_pages(cache):
    pages = cache.placement.alloc_device(P)
    cache.placement.free_device(pages)
    refused(cache, lambda: cache.placement.free_device(pages), "not leased")
    refused(cache, lambda: cache.placement.free_device((0,)), "not leased")


def test_unlock_below_zero_and_foreign_nodes(cache):
    node = cache.placement.match_prefix(cache.key(toks(1, 2))).last_device_node
    refused(cache, lambda: cache.placement.dec_lock_ref(node), "below zero")
    other = make_cache()
    put(other, toks(1))
    foreign = other.placement.match_prefix(other.key(toks(1))).last_device_node
    foreign.lock_ref = 1
    refused(cache, lambda: cache.placement.dec_lock_ref(foreign), "not a node of this tree")


def test_more_completions_than_pending(cache):
    refused(cache, lambda: cache.writes.complete(1), "1 writes completed but 0")
    refused(cache, lambda: cache.loads.complete(1), "1 loads completed but 0")
    refused(cache, lambda: cache.l3.complete_backups(-1), "backups completed")


def test_wrong_key_type_or_page_size(cache):
    refused(cache, lambda: cache.placement.match_prefix(toks(1)), "expected a TokenKey")
    refused(cache, lambda: cache.placement.match_prefix(TokenKey(toks(1), 8)), "page_size")
    refused(
        cache, lambda: cache.placement.insert(cache.key(toks(1)), (0,), priority="high"), "priority"
    )


def test_bad_pin_ttl(cache):
    refused(cache, lambda: cache.pin_prefix(cache.key(toks(1)), 0), "ttl_s")
    refused(cache, lambda: cache.pin_prefix(cache.key(toks(1)), "10"), "ttl_s")


def test_locking_a_node_that_is_not_on_device(cache):
    cache.device_evictions.evict(2 * P)
    node = cache.placement.match_prefix(cache.key(toks(1, 2))).last_host_node
    refused(cache, lambda: cache.placement.inc_lock_ref(node), "not on device")
