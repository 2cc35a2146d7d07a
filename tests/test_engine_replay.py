"""``kvfabric simulate --engine-pages`` (``fabric.tools.engine_replay``): the engine
tree served a trace the way the connector serves it, beside the flat LRU index
before it — on hand-made traces where the answer is known, and the command."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.cli import main
from fabric.tools.engine_replay import EngineSetup, replay
from tests.helpers import example_count


def setup(l2=0, l3=0, **more) -> EngineSetup:
    return EngineSetup(page_bytes=1, l2_bytes=l2, l3_bytes=l3, **more)


def test_with_room_for_everything_every_page_seen_before_hits():
    # The last page of a prompt is never loaded (its last token is computed).
    trace = [(1, 2, 3), (1, 2, 3, 4), (1, 2, 5)]
    r = replay(trace, setup())
    assert r.asked_pages == 2 + 3 + 2
    assert r.per_request == [(0, 0), (0, 3), (0, 2)]
    assert r.l3_pages_written == 3 + 1 + 1  # pages L3 newly held


def test_the_tree_keeps_a_prefix_the_flat_index_loses_by_its_first_page():
    """L3 holds 4 pages. A's prompt, then B's; A comes back. The flat LRU refreshes
    a prefix from its first page on, so A's first page is its oldest and leaves
    first, the pages after it kept but unreachable; the tree lets A's last page
    go (only as many pages as the room needs) and keeps its head."""
    trace = [(1, 2, 3), (7, 8), (1, 2, 3), (1, 2, 3)]
    tree, flat = replay(trace, setup(l3=4)), replay(trace, setup(l3=4), flat_lru=True)
    assert tree.per_request[2] == (0, 2) and flat.per_request[2] == (0, 0)
    assert tree.hit_rate() > flat.hit_rate()


def test_under_write_back_l3_is_written_only_as_pages_leave_the_nodes_l2():
    trace = [(1, 2, 3), (4, 5, 6), (1, 2, 3)]
    through = replay(trace, setup(l2=8, write_policy="write_through"))  # the tree fills 4
    back = replay(trace, setup(l2=8, write_policy="write_back"))
    # Every page computed, once (the third prompt's last page, stored again, is not
    # counted: L3 held it).
    assert through.l3_pages_written == 6
    # What left L2: A's last two pages for B's, then B's last two for A's return.
    assert back.l3_pages_written == 4
    assert back.hit_rate() == through.hit_rate() == 2 / 6
    assert back.per_request[2] == (1, 1)  # A's head in L2, its second page moved to L3


def test_under_best_effort_a_request_takes_its_nodes_l2_and_the_next_gets_the_prefetch():
    """Two nodes: the second engine's node lacks the prefix; best_effort does not
    wait for L3 but prefetches it, so the next request on that node hits L2."""
    trace = [(1, 2, 3), (1, 2, 3), (9,), (1, 2, 3)]
    s = setup(l2=100, engines=2, nodes=2, stop_policy="best_effort")
    r = replay(trace, s)
    assert r.per_request == [(0, 0), (0, 0), (0, 0), (2, 0)]
    timeout = replay(trace, setup(l2=100, engines=2, nodes=2))
    assert timeout.per_request[1] == (0, 2)  # read from L3 (and kept in its node's L2)


@settings(max_examples=example_count(60, 2000), deadline=None)
@given(
    trace=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=25),
    l3=st.sampled_from([0, 3, 6, 12]),
    l2=st.sampled_from([0, 4, 10]),
    write=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
)
def test_no_hit_is_of_a_page_never_stored_and_the_tiers_add_up(trace, l3, l2, write):
    r = replay(trace, setup(l2=l2, l3=l3, write_policy=write))
    seen: set[tuple[int, ...]] = set()
    for ids, (a, b) in zip(trace, r.per_request, strict=True):
        for k in range(a + b):
            assert tuple(ids[: k + 1]) in seen, "a hit on a prefix no request computed"
        seen |= {tuple(ids[: k + 1]) for k in range(len(ids))}
    assert sum(r.hit_pages.values()) == sum(a + b for a, b in r.per_request) <= r.asked_pages


def test_simulate_engine_pages_prints_each_write_policy_beside_the_flat_index(capsys):
    code = main(
        ["simulate", "--engine-pages", "--requests", "300", "--l2-bytes", str(1 << 20),
         "--set", f"storage.max_bytes={4 << 20}", "--json"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    e = out["engine_pages"]
    assert set(e["by_write_policy"]) == {"write_through", "write_back", "write_through_selective"}
    for figures in e["by_write_policy"].values():
        for side in ("tree", "flat_lru"):
            f = figures[side]
            assert f["hit_rate"] == pytest.approx(sum(f["by_tier"].values()), abs=2e-4)
            assert f["l3_bytes_written"] >= 0
    assert e["l3_bytes"] == 4 << 20 and out["requests"] == 300
