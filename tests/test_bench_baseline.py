"""The tree benchmark's baseline (SGLang's radix cache algorithm, re-written in
``bench/sglang_style_radix.py``) behaves as that cache does: a ratio against a
baseline that cached wrongly would measure nothing."""

import pathlib
import sys
from array import array

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

from sglang_style_radix import SGLangStyleRadixCache

P = 4


def ids(*pages: int) -> array:
    return array("q", [t for p in pages for t in [p] * P])


def test_hits_whole_pages_of_cached_prefixes_and_evicts_the_least_recent_leaf():
    c = SGLangStyleRadixCache(P, 6 * P)
    assert c.serve(ids(1, 2, 3)) == 0
    assert c.serve(ids(1, 2, 3)) == 3 * P
    assert c.serve(ids(1, 2, 9) + array("q", [5, 5])) == 2 * P, "unaligned tail never cached"
    assert c.serve(ids(7, 8)) == 0  # fills the 6 pages: 1 2 | 3, 9 | 7 8
    assert c.serve(ids(4)) == 0  # evicts the least recent leaf, [3]
    assert c.serve(ids(1, 2, 3)) == 2 * P
    assert c.evictable_size + c.protected_size == 6 * P
    assert c.allocator.available_size() == 0
    assert c.protected_size == 0, "every lock released"


def test_a_request_larger_than_the_pool_is_refused_and_changes_nothing():
    c = SGLangStyleRadixCache(P, 2 * P)
    assert c.serve(ids(1, 2, 3)) is None
    assert c.evictable_size == 0 and c.allocator.available_size() == 2 * P


def test_events_record_one_chained_hash_per_stored_page():
    c = SGLangStyleRadixCache(P, 8 * P, events=True)
    c.serve(ids(1, 2))
    c.serve(ids(1, 2, 3))
    (leaf,) = next(iter(c.root.children.values())).children.values()
    top = next(iter(c.root.children.values()))
    assert len(top.hashes) == 2 and len(leaf.hashes) == 1
    assert leaf.hashes[0] not in top.hashes
