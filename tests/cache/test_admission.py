"""Exact-state tests of the request lifecycle: chunked prefill, the request's own
tail page, decode appends, finish, abort and hits across requests."""

import pytest

from fabric.cache.admission import Admission
from fabric.cache.keys import pack_tokens
from fabric.errors import InvalidInput
from tests.helpers import P, make_cache, toks


def lifecycle(device_pages=8, host_pages=16, **options):
    cache = make_cache(device_pages=device_pages, host_pages=host_pages, **options)
    return cache, Admission(cache)


def cached(cache, tokens):
    """Tokens of ``tokens`` (whole pages) on device, without changing anything."""
    key = cache.key(tokens)
    return cache.tree.peek_device_pages(key.namespace, key.data) * P


def test_whole_prompt_with_an_unaligned_tail_keeps_the_tail_in_a_page_of_its_own():
    c, a = lifecycle()
    req = a.begin(pack_tokens([*toks(1, 2), 9, 9]))
    fill = a.prefill(req, 2 * P + 2)
    assert (fill.start, fill.first_new, fill.end) == (0, 0, 2 * P + 2)
    assert len(fill.pages) == 3 and fill.pages[-1] == req.tail_page
    assert req.tail_page in c.placement.leased and req.tail_page not in req.pages
    assert cached(c, toks(1, 2)) == 2 * P, "the whole pages are in the tree"
    assert req.node.lock_ref == 1 and req.computed == 2 * P + 2
    c.check_integrity()
    a.release(req)
    assert not c.placement.leased and req.node.lock_ref == 0
    assert c.ctl.device.available_pages == 8 - 2, "the tail page is freed, the tree keeps 2"
    c.check_integrity()


def test_chunked_prefill_moves_the_lock_and_a_second_request_hits_the_done_chunks():
    c, a = lifecycle()
    first = a.begin(pack_tokens(toks(1, 2, 3, 4, 5)))
    f1 = a.prefill(first, 2 * P)
    node1 = first.node
    assert (f1.start, f1.end, len(f1.pages)) == (0, 2 * P, 2) and node1.lock_ref == 1
    # Another request sharing the prefix hits the chunk already placed.
    other = a.begin(pack_tokens(toks(1, 2, 7)))
    a.prefill(other, 3 * P)
    assert other.device_hit == 2 * P and other.computed == P
    a.release(other)
    f2 = a.prefill(first, 4 * P)
    assert (f2.start, f2.first_new, f2.end) == (2 * P, 2 * P, 4 * P)
    assert first.node is not node1 and first.node.lock_ref == 1
    assert node1.lock_ref == 1, "locked once, through its child on the request's path"
    f3 = a.prefill(first, 5 * P)
    assert f3.pages == first.pages[4:] and first.computed == 5 * P and first.device_hit == 0
    assert list(first.device_pages) == list(
        c.placement.match_prefix(c.key(toks(1, 2, 3, 4, 5))).device_pages
    )
    c.check_integrity()
    a.release(first)
    assert c.tree.protected_size == 0
    c.check_integrity()


def test_decode_fills_its_own_page_then_the_page_joins_the_tree():
    c, a = lifecycle()
    req = a.begin(pack_tokens([*toks(1), 5]))
    a.prefill(req, P + 1)
    tail = req.tail_page
    for n, t in enumerate([6, 7], start=2):
        fill = a.append(req, pack_tokens([t]))
        assert (fill.start, fill.first_new, fill.end) == (P, P + n - 1, P + n)
        assert list(fill.pages) == [tail] and req.tail_page == tail
        assert cached(c, toks(1)) == P and len(req.pages) == 1
    fill = a.append(req, pack_tokens([8, 3]))  # fills the page and starts the next
    assert (fill.start, fill.first_new, fill.end) == (P, P + 3, 2 * P + 1)
    assert req.pages[-1] == tail, "the request's own page became the tree's page"
    assert req.tail_page != tail and list(fill.pages) == [tail, req.tail_page]
    assert cached(c, [1] * P + [5, 6, 7, 8]) == 2 * P
    assert req.computed == 2 * P + 1
    c.check_integrity()
    a.release(req)
    # The next turn (prompt + answer + new message) hits through the answer.
    nxt = a.begin(pack_tokens([1] * P + [5, 6, 7, 8] + [3, 4, 4, 4]))
    a.prefill(nxt, 3 * P)
    assert nxt.device_hit == 2 * P and nxt.computed == P
    a.release(nxt)
    c.check_integrity()


def test_a_page_another_request_completed_first_replaces_the_requests_own_page():
    c, a = lifecycle()
    slow = a.begin(pack_tokens([*toks(1), 2, 2]))
    a.prefill(slow, P + 2)
    own = slow.tail_page
    fast = a.begin(pack_tokens(toks(1, 2)))
    a.prefill(fast, 2 * P)
    a.release(fast)
    fill = a.append(slow, pack_tokens([2, 2]))
    assert own not in c.placement.leased and c.ctl.device.is_free(own), (
        "the duplicate page is freed"
    )
    assert slow.tail_page is None and fill.pages.tolist() == []
    assert slow.device_hit == 2 and slow.computed == P + 2, "the 2 tokens it lacked were hits"
    c.check_integrity()
    a.release(slow)
    c.check_integrity()


def test_no_room_changes_nothing_and_append_is_undone():
    c, a = lifecycle(device_pages=3)
    holder = a.begin(pack_tokens(toks(1, 2)))
    a.prefill(holder, 2 * P)
    req = a.begin(pack_tokens(toks(3, 4)))
    assert a.prefill(req, 2 * P) is None
    assert req.filled == 0 and req.node is c.tree.root and c.tree.protected_size == 2 * P
    small = a.begin(pack_tokens(toks(3)))
    a.prefill(small, P)
    assert a.append(small, pack_tokens([9])) is None, "no page left for the new tail"
    assert small.num_tokens == P and small.filled == P
    c.check_integrity()
    a.release(holder)
    assert a.append(small, pack_tokens([9])) is not None
    a.release(small)
    c.check_integrity()


def test_abort_mid_chunk_and_mid_decode_leaves_nothing_held():
    c, a = lifecycle()
    chunked = a.begin(pack_tokens([*toks(1, 2, 3), 4]))
    a.prefill(chunked, P)
    decoding = a.begin(pack_tokens([*toks(5), 6]))
    a.prefill(decoding, P + 1)
    a.append(decoding, pack_tokens([6]))
    a.release(chunked)
    a.release(decoding)
    assert not c.placement.leased and c.tree.protected_size == 0
    assert c.ctl.device.available_pages + c.tree.evictable_size // P == 8
    c.check_integrity()
    with pytest.raises(InvalidInput, match="ended"):
        a.prefill(chunked, 2 * P)


def test_bad_steps_are_refused_naming_the_value():
    c, a = lifecycle()
    req = a.begin(pack_tokens(toks(1, 2)))
    with pytest.raises(InvalidInput, match="prefill up to 9"):
        a.prefill(req, 9)
    a.prefill(req, P)
    with pytest.raises(InvalidInput, match=r"prefill up to 1 .*\[4, 8\]"):
        a.prefill(req, 1)
    with pytest.raises(InvalidInput, match="before the prompt is filled"):
        a.append(req, pack_tokens([1]))
    with pytest.raises(InvalidInput, match="packed"):
        a.append(req, b"\x01")
    with pytest.raises(InvalidInput, match="priority"):
        a.begin(pack_tokens([1]), priority="high")
    a.release(req)
    c.check_integrity()


def test_l2_and_l3_hits_are_counted_once_across_chunks():
    c, a = lifecycle(immediate=True)
    warm = a.begin(pack_tokens(toks(1, 2)))
    a.prefill(warm, 2 * P)
    a.release(warm)
    c.poll()
    c.writes.write_through()
    c.poll()
    assert c.device_evictions.evict(2 * P) == 2 * P
    req = a.begin(pack_tokens(toks(1, 2, 3)), prefetched=P)
    a.prefill(req, P)
    a.prefill(req, 3 * P)
    assert (req.device_hit, req.storage_hit, req.host_hit, req.computed) == (0, P, P, P)
    a.release(req)
    c.check_integrity()
