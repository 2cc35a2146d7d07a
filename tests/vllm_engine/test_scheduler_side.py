"""The connector's scheduler side without an engine: one coordinator call per step
for every request added before it, hits cut to whole blocks before the last token,
stores planned once per completed block and only over loads every rank loaded,
the save cursor following vLLM's rollback, delayed frees for finished requests,
resumed requests asking again, the L3 fallback and reports — with a fake link in
place of Ray and requests shaped as vLLM's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fabric.cache.engine_input import StoredRun
from fabric.engines.fabric_link import FabricLink
from fabric.engines.store import DirectStore, StoreOptions, parse_options
from fabric.engines.vllm_identity import engine_tag
from fabric.engines.vllm_names import PageNames
from fabric.engines.vllm_pages import (
    ConnectorOptions,
    FabricHandshake,
    FabricWorkerMeta,
    request_namespace,
)
from fabric.engines.vllm_scheduler import SchedulerSide
from fabric.errors import ConfigError
from fabric.l3.format import Provenance, page_key

pytestmark = pytest.mark.vllm

BLOCK = 4
SUFFIXES = ["0-0-0", "0-0-1"]
RANKS = ["a" * 64, "b" * 64]


class FakeLink:
    """A fabric that answers every chain with ``hits`` pages (or is down)."""

    def __init__(self, hits: int = 0, up: bool = True, store: StoreOptions | None = None):
        self.hits = hits
        self.up = up
        self.store = store
        self.l2_only = False  # the fabric's prefetch.stop_policy is not best_effort
        self.asked: list[list[list[bytes]]] = []
        self.reports: list[tuple[str, dict]] = []
        self.forgotten: list[bytes] = []
        self.leases: list[tuple[list[str], float, list[str]]] = []
        self.released: list[str] = []
        self.holds: list[tuple] = []
        self.names = PageNames()  # (the fabric publishes no KV events)

    def lookup(self, tag, world, chains, leases, lease_s, release, deadline, needs=None):
        if not self.up:
            return None
        self.asked.append(chains)
        self.needs = needs
        self.leases.append((leases, lease_s, release))
        return [min(self.hits, len(c)) for c in chains]

    def release(self, tag, world, names):
        self.released += names

    def hold(self, tag, world, chain, name, kind, ttl_s):
        self.holds.append((tag, world, list(chain), name, kind, ttl_s))

    def report(self, tag, world, stored):
        self.reports.append((tag, stored))

    def report_stored(self, world, stored):
        FabricLink.report_stored(self, world, stored)

    busy = False  # no fabric work outstanding

    def take_orders(self, ranks=1):
        return []

    def orders_done(self, batches):
        pass

    def forget(self, tag, world, hashes):
        self.forgotten += hashes

    def close(self):
        pass


class Req:
    """The fields of vLLM's ``Request`` the connector reads."""

    def __init__(self, rid: str, tokens: list[int], salt: str | None = None, **extra):
        self.request_id = rid
        self.prompt_token_ids = list(tokens)
        self.all_token_ids = list(tokens)
        self.lora_request = None
        self.cache_salt = salt
        self.mm_features = []
        self.prompt_embeds = None
        self.skip_reading_prefix_cache = False
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.__dict__.update(extra)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def output(new=(), cached=None, scheduled=None) -> SimpleNamespace:
    cached = cached or SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled or {},
    )  # fmt: skip


def running(rid: str, computed: int, new_blocks=None, resumed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        req_ids=[rid], resumed_req_ids={rid} if resumed else set(),
        new_block_ids=[new_blocks], num_computed_tokens=[computed],
    )  # fmt: skip


def new_req(rid: str, blocks: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)


def side(link: FakeLink, **options) -> SchedulerSide:
    s = SchedulerSide(ConnectorOptions(**options), SUFFIXES, BLOCK, link)
    s.handshake({r: FabricHandshake(r, d) for r, d in enumerate(RANKS)})
    return s


def outcome(*loads: tuple[int, int, int], stored=(), ended=(), failed=()) -> FabricWorkerMeta:
    return FabricWorkerMeta(list(stored), list(failed), list(ended), list(loads))


def both_ranks(load_id: int, pages: int, other: int | None = None) -> list[tuple[int, int, int]]:
    return [(0, load_id, pages), (1, load_id, pages if other is None else other)]


def test_every_request_added_before_a_step_is_asked_in_one_call():
    link = FakeLink(hits=2)
    s = side(link)
    reqs = [Req(f"r{i}", list(range(i, i + 13))) for i in range(3)]
    for r in reqs:
        s.new_request(r)
    assert link.asked == []
    assert s.matched(reqs[0], 0) == (2 * BLOCK, False)
    assert len(link.asked) == 1 and len(link.asked[0]) == 3
    # 13 tokens: 3 whole blocks before the last token; the fabric has 2 of them.
    assert [len(c) for c in link.asked[0]] == [3, 3, 3]
    assert s.matched(reqs[1], BLOCK) == (BLOCK, False)  # vLLM's own cache has one
    assert s.matched(reqs[2], 2 * BLOCK) == (0, False)
    assert len(link.asked) == 1
    # A request vLLM never announced is asked about when it is matched.
    late = Req("late", list(range(9)))
    assert s.matched(late, 0) == (2 * BLOCK, False)
    assert len(link.asked) == 2


def test_the_last_token_is_always_computed():
    s = side(FakeLink(hits=99))
    assert s.matched(Req("r", list(range(12))), 0) == (2 * BLOCK, False)  # 3 blocks: 2 load


def test_a_hit_loads_into_its_blocks_and_only_new_whole_blocks_are_stored_once():
    link = FakeLink(hits=2)
    s = side(link)
    r = Req("r", list(range(14)))
    s.new_request(r)
    assert s.matched(r, 0) == (8, False)
    s.allocated(r, None, 8)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    (load,) = meta.loads
    assert load.block_ids == (10, 11) and not load.asynchronous and load.tag == s.tag
    # Tokens 8..13 computed, block 2 whole: but over blocks being loaded, not stored yet.
    assert not meta.saves
    s.worker_output(outcome(*both_ranks(load.load_id, 2)))  # every rank loaded both
    r.all_token_ids += [50, 51]
    meta = s.step_meta(output(cached=running("r", 14), scheduled={"r": 2}))
    (save,) = meta.saves  # block 2 (computed last step) and block 3 (this step)
    assert save.block_ids == (12, 13) and save.run.parent == load.hashes[-1]
    assert not meta.loads
    assert not s.step_meta(output(cached=running("r", 16), scheduled={"r": 1})).saves
    # The engine keeps stepping until every rank reported both stores ended, and a
    # request sharing a page still being stored waits for it (asks again).
    first, last = save.run.hashes
    assert s.pending_writes()
    twin = Req("twin", [*range(14), 50, 51, 52])
    s.new_request(twin)
    assert s.matched(twin, 0) == (None, False)
    s.worker_output(
        outcome(stored=[(s.tag, 0, save.run)], ended=[(0, first), (0, last), (1, first)])
    )
    assert s.pending_writes()
    assert s.matched(twin, 0) == (None, False)
    s.worker_output(outcome(ended=[(1, last)]))
    assert not s.pending_writes()
    assert link.reports[0] == (s.tag, {0: [save.run]})
    link.hits = 4
    assert s.matched(twin, 0) == (4 * BLOCK, False)


def test_pages_computed_over_a_load_that_failed_on_any_rank_are_never_stored():
    """Rank 1 loads one page of two: the pages computed in that step (over a stale
    block, spread to every rank by the all-reduce) are stored by no rank; vLLM rolls
    the request back to the failed page, and the recomputed pages are stored."""
    link = FakeLink(hits=2)
    s = side(link)
    r = Req("r", list(range(14)))
    s.matched(r, 0)
    s.allocated(r, None, 8)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    (load,) = meta.loads
    assert not meta.saves
    # With async scheduling the next step is planned before the outcome is known.
    r.all_token_ids += [50]
    assert not s.step_meta(output(cached=running("r", 14), scheduled={"r": 1})).saves
    s.worker_output(
        outcome(*both_ranks(load.load_id, 2, other=1), failed=[(s.tag, 1, load.hashes[1])])
    )
    assert link.forgotten == [load.hashes[1]]
    # vLLM recomputes from page 1 (token 4): the pages from there on are stored.
    meta = s.step_meta(output(cached=running("r", 4), scheduled={"r": 11}))
    (save,) = meta.saves
    assert save.block_ids == (11, 12) and save.run.hashes[0] == load.hashes[1]
    assert save.run.parent == load.hashes[0]


def test_a_request_sharing_a_block_that_is_loading_stores_nothing_until_it_is_known():
    """vLLM's prefix cache hands a block being loaded to a second request in the
    same step: that request's pages wait for the load's outcome too."""
    link = FakeLink(hits=2)
    s = side(link)
    a, b = Req("a", list(range(14))), Req("b", [*range(8), *range(100, 106)])
    s.matched(a, 0)
    s.allocated(a, None, 8)
    s.matched(b, 8)  # vLLM's own cache has its first two blocks: nothing to load
    meta = s.step_meta(
        output([new_req("a", [10, 11, 12, 13], 8), new_req("b", [10, 11, 20, 21], 8)],
               scheduled={"a": 6, "b": 6})
    )  # fmt: skip
    assert len(meta.loads) == 1 and not meta.saves
    s.worker_output(outcome(*both_ranks(meta.loads[0].load_id, 2)))
    meta = s.step_meta(output(cached=running("b", 14), scheduled={"b": 1}))
    (save,) = meta.saves
    assert save.block_ids == (20,)


def test_asynchronous_loads_start_from_the_blocks_vllm_allocated_and_a_failure_rolls_back():
    link = FakeLink(hits=3)
    s = side(link, load_async=True)
    r = Req("r", list(range(20)))
    s.new_request(r)
    assert s.matched(r, 0) == (12, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10, 11],))
    s.allocated(r, blocks, 12)
    (load,) = s.step_meta(output()).loads  # the request itself is not scheduled
    assert load.asynchronous and load.block_ids == (7, 8, 9)
    s.worker_output(outcome(*both_ranks(load.load_id, 1)))  # page 1 failed
    meta = s.step_meta(output([new_req("r", [7, 8, 9, 10, 11], 4)], scheduled={"r": 16}))
    (save,) = meta.saves
    assert save.block_ids == (8, 9, 10, 11)  # the recomputed pages are stored


def test_a_request_aborted_while_its_asynchronous_load_runs_keeps_its_blocks():
    s = side(FakeLink(hits=3), load_async=True)
    r = Req("r", list(range(20)))
    s.matched(r, 0)
    s.allocated(r, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10, 11],)), 12)
    (load,) = s.step_meta(output()).loads
    assert s.finished(r, [7, 8, 9, 10, 11])  # the load thread still writes them
    s.worker_output(outcome(*both_ranks(load.load_id, 3)))
    assert not s.step_meta(output()).saves


def test_a_finished_request_keeps_its_blocks_until_its_last_pages_are_stored():
    """A request that ends in the step of its load (one output token): its computed
    pages are stored once the load is known good, from blocks vLLM keeps for it."""
    s = side(FakeLink(hits=2))
    r = Req("r", list(range(14)))
    s.matched(r, 0)
    s.allocated(r, None, 8)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    r.num_computed_tokens = 14
    assert s.finished(r, [10, 11, 12, 13])
    assert s.pending_writes()
    s.worker_output(outcome(*both_ranks(meta.loads[0].load_id, 2)))
    meta = s.step_meta(output())
    (save,) = meta.saves
    assert save.block_ids == (12,) and meta.finished == ["r"]
    assert not s.step_meta(output()).finished
    # One whose load failed keeps nothing: its blocks are let go unstored.
    bad = Req("bad", list(range(100, 114)))
    s.matched(bad, 0)
    s.allocated(bad, None, 8)
    meta = s.step_meta(output([new_req("bad", [1, 2, 3, 4], 8)], scheduled={"bad": 6}))
    bad.num_computed_tokens = 14
    assert s.finished(bad, [1, 2, 3, 4])
    s.worker_output(outcome(*both_ranks(meta.loads[0].load_id, 2, other=0)))
    meta = s.step_meta(output())
    assert not meta.saves and meta.finished == ["bad"]
    # Nothing left to store: the blocks go at once.
    done = Req("done", list(range(7)))
    s.matched(done, 0)
    done.num_computed_tokens = 7
    assert not s.finished(done, [5, 6])


def test_a_resumed_request_asks_again_over_its_output_tokens():
    link = FakeLink(hits=0)
    s = side(link)
    r = Req("r", list(range(9)))
    assert s.matched(r, 0) == (0, False)
    (save,) = s.step_meta(output([new_req("r", [1, 2, 3])], scheduled={"r": 9})).saves
    s.worker_output(outcome(ended=[(k, h) for k in (0, 1) for h in save.run.hashes]))
    r.all_token_ids += [40, 41, 42, 43]  # 13 tokens: its output made page 2 whole
    link.hits = 3
    assert s.matched(r, 0) == (12, False)  # preempted: it asks again, all 3 pages count
    assert [len(c) for c in link.asked[-1]] == [3]
    s.allocated(r, None, 12)
    meta = s.step_meta(output(cached=running("r", 12, [[5, 6, 7, 8]], resumed=True),
                              scheduled={"r": 1}))  # fmt: skip
    assert meta.loads[0].block_ids == (5, 6, 7)


def test_only_whole_pages_of_real_tokens_are_hashed_and_stored():
    """Async scheduling counts a token before it is sampled, and speculative decoding
    counts draft tokens: neither is hashed, so a later page never chains from junk."""
    s = side(FakeLink(hits=0))
    r = Req("r", list(range(10)))
    s.matched(r, 0)
    meta = s.step_meta(output([new_req("r", [1, 2, 3, 4])], scheduled={"r": 10}))
    assert [save.block_ids for save in meta.saves] == [(1, 2)]
    # Two placeholders and three drafts scheduled: 15 tokens counted, 11 real.
    r.all_token_ids += [77]
    meta = s.step_meta(output(cached=running("r", 10), scheduled={"r": 5}))
    assert not meta.saves
    state = s.tracked["r"]
    assert len(state.hashes) == 2
    r.all_token_ids += [78]  # now page 2 is whole and real
    (save,) = s.step_meta(output(cached=running("r", 15), scheduled={"r": 1})).saves
    assert save.block_ids == (3,)
    expected = SchedulerSide(ConnectorOptions(), SUFFIXES, BLOCK, FakeLink())
    expected.handshake({i: FabricHandshake(i, d) for i, d in enumerate(RANKS)})
    twin = expected._track(Req("t", r.all_token_ids))
    twin.hashes_to(3, BLOCK)
    assert save.run.hashes[0] == twin.hashes[2]


def test_requests_not_named_by_their_tokens_are_neither_loaded_nor_stored():
    link = FakeLink(hits=5)
    s = side(link)
    embeds = Req("e", [0] * 20, prompt_embeds=object())
    image = Req("i", list(range(20)), mm_features=[object()])
    for r in (embeds, image):
        s.new_request(r)
        assert s.matched(r, 0) == (0, False)
        assert r.request_id not in s.tracked
    assert link.asked == []


def test_a_request_that_skips_reading_the_prefix_cache_loads_nothing_but_stores():
    link = FakeLink(hits=5)
    s = side(link)
    r = Req("r", list(range(20)), skip_reading_prefix_cache=True)
    s.new_request(r)
    assert s.matched(r, 0) == (0, False)
    assert link.asked == []
    meta = s.step_meta(output([new_req("r", [1, 2, 3, 4, 5])], scheduled={"r": 20}))
    assert [save.block_ids for save in meta.saves] == [(1, 2, 3, 4, 5)]


def test_a_reset_stores_under_a_new_tag_and_requests_from_before_store_nothing():
    link = FakeLink(hits=0)
    s = side(link)
    old = s.tag
    before = Req("before", list(range(9)))
    s.matched(before, 0)
    assert s.reset()
    assert s.tag != old and s.tag == engine_tag(RANKS, s.engine._epoch)
    assert not s.step_meta(output([new_req("before", [1, 2, 3])], scheduled={"before": 9})).saves
    after = Req("after", list(range(9)))
    s.matched(after, 0)
    (save,) = s.step_meta(output([new_req("after", [4, 5, 6])], scheduled={"after": 9})).saves
    assert save.tag == s.tag
    assert link.asked[-1]  # asked under the new tag
    # Two resets are two epochs (random), never a counter a restart could repeat.
    again = s.tag
    s.reset()
    assert s.tag not in (old, again)


def test_an_engine_whose_workers_did_not_say_what_their_pages_are_stays_off():
    link = FakeLink(hits=5)
    s = SchedulerSide(ConnectorOptions(), SUFFIXES, BLOCK, link)
    r = Req("r", list(range(20)))
    s.new_request(r)
    assert s.matched(r, 0) == (0, False)
    s.handshake({0: FabricHandshake(0, "a" * 64), 1: FabricHandshake(1, "")})  # rank 1 can't
    assert s.tag is None and s.matched(r, 0) == (0, False)
    assert not s.step_meta(output([new_req("r", [1, 2, 3, 4, 5])], scheduled={"r": 20})).saves
    assert link.asked == []


def test_engines_that_differ_in_any_rank_get_other_tags():
    assert engine_tag(RANKS, "") != engine_tag([RANKS[0], "c" * 64], "")
    assert engine_tag(RANKS, "") != engine_tag(list(reversed(RANKS)), "")
    assert engine_tag(RANKS, "") != engine_tag(RANKS, "e")


def test_cache_salts_and_tenants_get_chains_of_their_own():
    link = FakeLink()
    s = side(link)
    tokens = list(range(9))
    reqs = [Req(rid, tokens, salt) for rid, salt in (("a", None), ("b", "s"), ("c", "t"))]
    for r in reqs:
        s.new_request(r)
    s.matched(reqs[0], 0)
    (chains,) = link.asked
    assert len({c[0] for c in chains}) == 3
    assert request_namespace("t", None, None) == "t"
    assert request_namespace("t", "s", None) != request_namespace("t", None, "s")


def test_a_lora_adapter_is_named_by_its_weights_not_its_name(tmp_path):
    link = FakeLink()
    s = side(link)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights one")
    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(adapter))
    first = s._track(Req("a", list(range(9)), lora_request=lora))
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_model.safetensors").write_bytes(b"weights two")
    renamed = SimpleNamespace(lora_name="sql", lora_int_id=2, lora_path=str(other))
    second = s._track(Req("b", list(range(9)), lora_request=renamed))
    plain = s._track(Req("c", list(range(9))))
    assert len({first.namespace, second.namespace, plain.namespace}) == 3
    # Replaced in place while vLLM keeps the first version loaded under its id: its
    # KV may be either version's, so the adapter is no longer served by the fabric.
    (adapter / "adapter_model.safetensors").write_bytes(b"weights three")
    assert s._track(Req("e", list(range(9)), lora_request=lora)) is None
    # An adapter whose files cannot be read: its requests are not served at all.
    gone = SimpleNamespace(lora_name="x", lora_int_id=2, lora_path=str(tmp_path / "none"))
    r = Req("d", list(range(9)), lora_request=gone)
    s.new_request(r)
    assert s.matched(r, 0) == (0, False) and "d" not in s.tracked
    assert not s.step_meta(output([new_req("d", [1, 2, 3])], scheduled={"d": 9})).saves


def test_a_down_fabric_answers_from_the_store_alone(tmp_path):
    options = StoreOptions(path=str(tmp_path))
    link = FakeLink(up=False, store=options)
    s = side(link)
    r = Req("r", list(range(17)))  # 4 whole blocks before the last token
    hashes = _chain(s, r)
    provenance = Provenance("m", "vllm-block/x", "uint8", (1,), BLOCK)
    store = DirectStore(options, "vllm")
    rows = np.zeros((3, 8), dtype=np.uint8)
    # Both shards of pages 0 and 1; page 2 for one shard only.
    store.store([page_key(h, s.tag, "0-0-0") for h in hashes[:3]], rows, provenance)
    store.store([page_key(h, s.tag, "0-0-1") for h in hashes[:2]], rows[:2], provenance)
    store.close()
    assert s.matched(r, 0) == (2 * BLOCK, False)
    assert link.asked == [] and link.reports == []
    s.close()


def test_the_store_extends_the_fabrics_answer_and_the_fabric_is_told(tmp_path):
    options = StoreOptions(path=str(tmp_path))
    link = FakeLink(hits=1, store=options)
    s = side(link)
    r = Req("r", list(range(17)))
    hashes = _chain(s, r)
    provenance = Provenance("m", "vllm-block/x", "uint8", (1,), BLOCK)
    store = DirectStore(options, "vllm")
    for suffix in SUFFIXES:
        store.store(
            [page_key(h, s.tag, suffix) for h in hashes[1:3]], np.zeros((2, 8), np.uint8),
            provenance,
        )  # fmt: skip
    store.close()
    assert s.matched(r, 0) == (3 * BLOCK, False)
    (report,) = link.reports
    run = StoredRun("vllm", hashes[0], tuple(hashes[1:3]))
    assert report == (s.tag, {0: [run], 1: [run]})
    # A page a worker failed to load is not found in the store again.
    s.worker_output(outcome(failed=[(s.tag, 1, hashes[1])]))
    assert link.forgotten == [hashes[1]]
    assert s.matched(Req("r2", list(range(17))), 0) == (BLOCK, False)
    s.close()


def _store_every_shard(options: StoreOptions, tag: str, hashes: list[bytes]) -> None:
    """Every rank's shard of the pages ``hashes`` in the store, written directly."""
    provenance = Provenance("m", "vllm-block/x", "uint8", (1,), BLOCK)
    store = DirectStore(options, "vllm")
    for suffix in SUFFIXES:
        rows = np.zeros((len(hashes), 8), np.uint8)
        store.store([page_key(h, tag, suffix) for h in hashes], rows, provenance)
    store.close()


def test_a_final_answer_is_not_extended_over_what_the_store_still_holds(tmp_path):
    """The fabric evicted the page after its answer (``final``): the store may hold
    it until its delete is carried out, but it is not served or reported back."""
    from fabric.engines.fabric_link import decode_answers

    options = StoreOptions(path=str(tmp_path))
    link = FakeLink(hits=1, store=options)
    s = side(link)
    r = Req("r", list(range(17)))
    hashes = _chain(s, r)
    _store_every_shard(options, s.tag, hashes[1:3])
    link.lookup = lambda *a, **k: decode_answers([-2])  # 1 page, final
    assert s.matched(r, 0) == (BLOCK, False)
    assert link.reports == []
    s.close()


def test_under_best_effort_pages_only_l3_holds_are_told_to_the_fabric_not_loaded(tmp_path):
    """The fabric's best_effort answers from the node's L2 and prefetches the rest
    into it: what the store holds beyond the answer is reported (the fabric may
    not know it), never taken into the hit."""
    options = StoreOptions(path=str(tmp_path), prefetch_stop_policy="best_effort")
    link = FakeLink(hits=1, store=options)
    link.l2_only = True
    s = side(link)
    r = Req("r", list(range(17)))
    hashes = _chain(s, r)
    _store_every_shard(options, s.tag, hashes[1:3])
    assert s.matched(r, 0) == (BLOCK, False)
    run = StoredRun("vllm", hashes[0], tuple(hashes[1:3]))
    assert link.reports == [(s.tag, {0: [run], 1: [run]})]
    s.close()


@pytest.mark.parametrize(
    ("policy", "limit_s"), [("timeout", 1.5 + 2.0 * 3 * BLOCK / 1024), ("wait_complete", 0.0)]
)
def test_a_load_carries_its_chain_and_the_fabrics_prefetch_limit(policy, limit_s):
    """A load names its pages' namespace and parent (what a page read from L3 is
    reported as once the node's L2 keeps it) and, under the fabric's ``timeout``
    prefetch stop policy, the limit on its L3 reads for its tokens (none under
    ``wait_complete``: the connector's ``timeout_s`` alone bounds it)."""
    options = StoreOptions(
        fabric="f", prefetch_stop_policy=policy, prefetch_timeout_s=(1.5, 2.0, 9.0)
    )
    s = side(FakeLink(hits=4, store=options))
    r = Req("r", list(range(17)))
    hashes = _chain(s, r)
    assert s.matched(r, 4) == (3 * BLOCK, False)
    s.allocated(r, None, 3 * BLOCK)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13, 14], 4)], scheduled={"r": 13}))
    (load,) = meta.loads
    assert (load.namespace, load.parent, load.hashes) == ("vllm", hashes[0], tuple(hashes[1:4]))
    assert load.limit_s == pytest.approx(limit_s)
    assert load.run(1) == StoredRun("vllm", hashes[1], tuple(hashes[2:4]))


def _chain(s: SchedulerSide, r: Req) -> list[bytes]:
    state = s._track(r)
    state.hashes_to((r.num_tokens - 1) // BLOCK, BLOCK)
    return state.hashes


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"namespace": ""}, "namespace=''"),
        ({"fabric": 3}, "fabric=3"),
        ({"path": "/x", "nope": 1}, "'nope' is unknown"),
    ],
)
def test_bad_connector_options_are_refused_naming_them(options, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_options(ConnectorOptions, options, "kv_connector_extra_config")


def test_matched_pages_are_leased_until_every_rank_loaded_them_then_released_at_once():
    link = FakeLink(hits=2)
    s = side(link, lease_s=7.0)
    r, miss = Req("r", list(range(14))), Req("m", list(range(100, 114)))
    s.new_request(r)
    s.new_request(miss)
    assert s.matched(r, 0) == (8, False)
    (names, lease_s, release) = link.leases[0]
    assert lease_s == 7.0 and release == [] and len(names) == 2
    assert names[0].endswith("/r") and names[1].endswith("/m")
    s.allocated(r, None, 8)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    s.worker_output(outcome((0, meta.loads[0].load_id, 2)))  # one rank of two: still held
    assert link.released == []
    s.worker_output(outcome((1, meta.loads[0].load_id, 2)))
    assert link.released == [names[0]]  # without waiting for another lookup
    # A request whose loads ran asynchronously releases when its load is reported.
    link2 = FakeLink(hits=2)
    s2 = side(link2, load_async=True)
    a = Req("a", list(range(14)))
    s2.new_request(a)
    assert s2.matched(a, 0) == (8, True)
    s2.allocated(a, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 8)
    (load,) = s2.step_meta(output()).loads
    s2.worker_output(outcome(*both_ranks(load.load_id, 2)))
    assert link2.released == [link2.leases[0][0][0]]


def test_a_finished_request_releases_a_lease_never_loaded_and_no_lease_is_taken_at_zero():
    link = FakeLink(hits=2)
    s = side(link)
    r = Req("r", list(range(14)))
    s.matched(r, 0)
    s.finished(r, [])  # aborted before it was scheduled
    s.worker_output(None)
    assert link.released == [link.leases[0][0][0]]
    off = FakeLink(hits=2)
    s0 = side(off, lease_s=0)
    s0.matched(Req("r", list(range(14))), 0)
    s0.finished(Req("r", []), [])
    s0.worker_output(None)
    assert off.leases[0][1] == 0 and off.released == []


def test_a_load_no_rank_ever_reports_lets_its_requests_go_without_storing(monkeypatch):
    from fabric.engines import vllm_scheduler

    now = [0.0]
    link = FakeLink(hits=2)
    s = SchedulerSide(ConnectorOptions(), SUFFIXES, BLOCK, link, clock=lambda: now[0])
    s.handshake({r: FabricHandshake(r, d) for r, d in enumerate(RANKS)})
    r = Req("r", list(range(14)))
    s.matched(r, 0)
    s.allocated(r, None, 8)
    s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    now[0] = vllm_scheduler.WRITE_STALL_S + 1
    assert not s.step_meta(output(cached=running("r", 14), scheduled={"r": 1})).saves
    assert s.tracked["r"].no_save and not s.loads.loads and not s.loads.pending_blocks


def test_each_pipeline_stages_pages_are_found_under_the_engines_one_tag(tmp_path):
    """PP=2: the scheduler holds stage 0's KV cache config only, but the engine's
    tag is named from every rank's identity, so the L3 fallback (a coordinator
    restarted) finds both stages' pages, each under its stage's suffix."""
    options = StoreOptions(path=str(tmp_path))
    stages = ["0-0-0", "1-0-0"]
    s = SchedulerSide(ConnectorOptions(), stages, BLOCK, FakeLink(up=False, store=options))
    s.handshake({0: FabricHandshake(0, "a" * 64), 1: FabricHandshake(1, "c" * 64)})
    r = Req("r", list(range(17)))
    hashes = _chain(s, r)
    store = DirectStore(options, "vllm")
    provenance = Provenance("m", "vllm-block/x", "uint8", (1,), BLOCK)
    for stage in stages:
        store.store([page_key(h, s.tag, stage) for h in hashes], np.zeros((4, 8), np.uint8),
                    provenance)  # fmt: skip
    store.close()
    assert s.matched(r, 0) == (4 * BLOCK, False)
    s.close()


def test_a_request_planned_before_the_load_of_a_block_it_shares_still_waits_for_it():
    """A resumed request's load (among the cached requests) fills a block that a new
    request, planned first, shares: every load of the step opens before any
    request's stores are planned."""
    link = FakeLink(hits=0)
    s = side(link)
    a = Req("a", list(range(14)))
    s.matched(a, 0)
    s.step_meta(output([new_req("a", [1, 2, 3, 4])], scheduled={"a": 14}))  # computed, stored
    s.worker_output(outcome(ended=[(k, h) for k in (0, 1) for h in s.tracked["a"].hashes]))
    link.hits = 3
    assert s.matched(a, 0) == (12, False)  # preempted: resumes loading its three pages
    s.allocated(a, None, 12)
    b = Req("b", [*range(12), 90, 91, 92, 93, 94])
    s.matched(b, 12)  # vLLM's cache hands it a's (loading) blocks
    meta = s.step_meta(
        output([new_req("b", [5, 6, 7, 9, 10], 12)], cached=running("a", 12, [[5, 6, 7, 8]],
               resumed=True), scheduled={"b": 5, "a": 2})
    )  # fmt: skip
    assert len(meta.loads) == 1 and not meta.saves  # b waits for a's load


def stale_block_two() -> SchedulerSide:
    """Request a (blocks 1-4) loaded three pages and every rank failed the second:
    block 2 is stale, and the fabric now answers nothing."""
    link = FakeLink(hits=3)
    s = side(link)
    a = Req("a", list(range(14)))
    s.matched(a, 0)
    s.allocated(a, None, 12)
    meta = s.step_meta(output([new_req("a", [1, 2, 3, 4], 12)], scheduled={"a": 2}))
    s.worker_output(outcome(*both_ranks(meta.loads[0].load_id, 1)))
    link.hits = 0
    return s


def test_a_block_a_failed_load_left_stale_taints_whoever_uses_it_until_recomputed():
    """a's load fails on page 1 and a is preempted before recomputing it: vLLM keeps
    the stale block in its prefix cache. c, which then uses it as computed, stores
    nothing; once a request computes the block anew, it is clean again."""
    s = stale_block_two()
    c = Req("c", [*range(12), 70, 71, 72, 73, 74, 75])
    s.matched(c, 12)  # vLLM's own cache: blocks 1, 2, 3 (block 2 stale)
    assert not s.step_meta(output([new_req("c", [1, 2, 3, 7, 8], 12)], scheduled={"c": 6})).saves
    assert s.tracked["c"].no_save
    d = Req("d", list(range(14)))
    s.matched(d, 4)  # computes from page 1 on: block 2 is made anew
    (save,) = s.step_meta(output([new_req("d", [1, 2, 3, 9], 4)], scheduled={"d": 10})).saves
    assert save.block_ids == (1, 2, 3) and not s.tracked["d"].no_save
    e = Req("e", [*range(12), 50, 51])
    s.new_request(e)
    s.step_meta(output([new_req("e", [1, 2, 3, 11], 12)], scheduled={"e": 2}))
    assert not s.tracked["e"].no_save  # block 2 is clean again


def test_after_a_reset_a_waiting_request_asks_again_and_asynchronous_loads_are_given_up():
    link = FakeLink(hits=2)
    s = side(link, load_async=True)
    waiting, loading = Req("w", list(range(14))), Req("l", list(range(100, 114)))
    assert s.matched(waiting, 0) == (8, True)  # vLLM had no room for it: it stays waiting
    s.matched(loading, 0)
    s.allocated(loading, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)), 8)
    s.step_meta(output())
    old = s.tag
    s.reset()
    asked = len(link.asked)
    assert s.matched(waiting, 0) == (8, True)
    assert len(link.asked) == asked + 1  # under the new tag, not the old answer
    assert s.tracked["w"].asked_tag == s.tag != old
    assert s.step_meta(output()).cancel == ["l"]


def test_a_stale_block_computed_anew_over_two_steps_is_clean_only_once_whole():
    """a's failed page is recomputed in a chunk that stops mid-page: another request
    using the block meanwhile stores nothing; a itself goes on, and once its next
    chunk reaches the page's end the block is clean."""
    s = stale_block_two()
    t = Req("t", [*range(12), 60, 61])
    s.matched(t, 12)
    # a recomputes tokens 4..5 of page 1 (block 2) only; t uses block 2 as computed.
    s.step_meta(output([new_req("t", [1, 2, 3, 9], 12)], cached=running("a", 4),
                       scheduled={"a": 2, "t": 2}))  # fmt: skip
    assert s.tracked["t"].no_save and not s.tracked["a"].no_save
    assert 2 in s.loads.poisoned
    (save,) = s.step_meta(output(cached=running("a", 6), scheduled={"a": 8})).saves
    assert save.block_ids == (2, 3) and 2 not in s.loads.poisoned


def test_what_a_request_computes_over_a_stale_block_is_stale_too():
    s = stale_block_two()
    c = Req("c", [*range(12), *range(70, 82)])
    s.matched(c, 12)  # a's blocks 1, 2, 3 from vLLM's cache, its own 7, 8, 9 computed
    s.step_meta(output([new_req("c", [1, 2, 3, 7, 8, 9], 12)], scheduled={"c": 12}))
    assert s.tracked["c"].no_save and {7, 8, 9} <= s.loads.poisoned
    d = Req("d", [*range(12), *range(70, 78), 5])
    s.matched(d, 20)  # c's blocks from vLLM's cache: it stores nothing either
    s.step_meta(output([new_req("d", [1, 2, 3, 7, 8, 10], 20)], scheduled={"d": 1}))
    assert s.tracked["d"].no_save


def test_a_request_finished_while_a_load_it_shares_is_pending_keeps_its_blocks():
    """A waiter that finishes before the load's outcome keeps its blocks until then,
    so that they are known stale if the load failed."""
    link = FakeLink(hits=2)
    s = side(link)
    a, b = Req("a", list(range(14))), Req("b", [*range(8), 90, 91, 92, 93, 94])
    s.matched(a, 0)
    s.allocated(a, None, 8)
    s.matched(b, 8)
    meta = s.step_meta(output([new_req("a", [10, 11, 12, 13], 8),
                               new_req("b", [10, 11, 20, 21], 8)], scheduled={"a": 6, "b": 5}))  # fmt: skip
    b.num_computed_tokens = 13
    assert s.finished(b, [10, 11, 20, 21])  # its blocks are kept
    s.worker_output(outcome(*both_ranks(meta.loads[0].load_id, 2, other=1)))  # block 11 failed
    assert {11, 20, 21} <= s.loads.poisoned
    out = s.step_meta(output())
    assert out.finished == ["b"] and not out.saves


def test_a_request_that_asks_for_a_session_or_a_pin_holds_its_prefix_once_it_ends(caplog):
    """``kv_transfer_params``: ``kvfabric_session`` holds the prefix the request
    computed (its whole pages) as the conversation's, ``kvfabric_pin_s`` pins it
    for that long; a bad value is logged by name and the request served as ever."""
    link = FakeLink()
    s = side(link)
    params = {"kvfabric_session": "conv-7", "kvfabric_pin_s": 120}
    r = Req("r", list(range(14)), kv_transfer_params=params)
    s.matched(r, 0)
    r.all_token_ids += [50, 51, 52]  # decoded: 17 tokens, 4 whole pages
    r.num_computed_tokens = 16
    s.finished(r, [1, 2, 3, 4])
    chain = _chain(s, Req("x", [*range(14), 50, 51, 52]))[:4]
    assert link.holds == [
        (s.tag, 2, chain, "conv-7", "session", None),
        (s.tag, 2, chain, "pin/" + chain[-1].hex(), "pin", 120.0),
    ]
    bad = {"kvfabric_session": "", "kvfabric_pin_s": True}
    r2 = Req("r2", list(range(14)), kv_transfer_params=bad)
    s.matched(r2, 0)
    r2.num_computed_tokens = 13
    with caplog.at_level("WARNING"):
        s.finished(r2, [5, 6, 7, 8])
    assert len(link.holds) == 2
    assert "kvfabric_session='' is ignored" in caplog.text
    assert "kvfabric_pin_s=True is ignored" in caplog.text
    r3 = Req("r3", list(range(14)), kv_transfer_params={"other": 1})
    s.matched(r3, 0)
    r3.num_computed_tokens = 13
    s.finished(r3, [9])
    assert len(link.holds) == 2


# -- a hybrid engine (``vllm_hybrid``): a sliding-window group, a state group, the chain


def hybrid_side(link: FakeLink) -> SchedulerSide:
    from fabric.engines.vllm_groups import FULL, STATE, WINDOW, KvGroup

    groups = [
        KvGroup(0, WINDOW, ("w",), BLOCK, 64, 2, "window"),
        KvGroup(1, STATE, ("s",), BLOCK, 32, 1, "state"),
        KvGroup(2, FULL, ("f",), BLOCK, 64, 0, "full"),
    ]
    s = SchedulerSide(ConnectorOptions(), SUFFIXES, BLOCK, link, groups=groups)
    s.handshake({r: FabricHandshake(r, d) for r, d in enumerate(RANKS)})
    return s


def test_a_hybrid_hit_loads_the_window_and_the_state_it_needs_and_never_a_tombstone():
    link = FakeLink(hits=3)
    s = hybrid_side(link)
    assert s.options.load_async  # vLLM takes a hybrid engine's failed loads per request
    r = Req("r", list(range(17)))
    s.new_request(r)
    assert s.matched(r, 0) == (3 * BLOCK, True)
    assert [before for _, before in link.needs] == [2, 1]  # the window, the state
    # vLLM's tables: the window group's first page a tombstone (null block 0).
    tables = ([0, 21, 22, 23, 24], [0, 0, 32, 33, 34], [40, 41, 42, 43, 44])
    s.allocated(r, SimpleNamespace(get_block_ids=lambda: tables), 3 * BLOCK)
    meta = s.step_meta(output())
    by_group = {g: [j for j in meta.loads if j.group == g] for g in (0, 1, 2)}
    (chain,) = by_group[2]
    assert chain.block_ids == (40, 41, 42) and chain.tag == s.tag and chain.asynchronous
    # The window: pages 1 and 2 (the two before the hit point), each a page of its own.
    assert [(j.block_ids, j.parent) for j in by_group[0]] == [((21,), None), ((22,), None)]
    assert [j.hashes[0] for j in by_group[0]] == list(chain.hashes[1:3])
    (state,) = by_group[1]  # the state at the hit point: its last page's block
    assert state.block_ids == (32,) and state.hashes == chain.hashes[2:3]
    assert len({j.tag for j in meta.loads}) == 3 and len({j.load_id for j in meta.loads}) == 4
    assert set(meta.groups.values()) == {0, 1, 2}


def test_a_hybrid_store_keeps_the_window_before_its_end_and_the_states_handed_off():
    link = FakeLink(hits=0)
    s = hybrid_side(link)
    r = Req("r", list(range(14)))
    s.new_request(r)
    assert s.matched(r, 0) == (0, False)
    tables = ([0, 11, 12, 13], [0, 0, 0, 23], [30, 31, 32, 33])
    out = output([SimpleNamespace(req_id="r", block_ids=tables, num_computed_tokens=0)],
                 scheduled={"r": 14})  # fmt: skip
    # vLLM hands off the state at token 12 in block 22 (not the table's block 23).
    out.kv_connector_block_state = SimpleNamespace(
        get_block_ids=lambda rid: tables, boundary_state_offloads={"r": [(1, 22, 12)]}
    )
    meta = s.step_meta(out)
    saves = {g: [(j.block_ids, j.run.parent) for j in meta.saves if j.group == g] for g in range(3)}
    assert saves[2] == [((30, 31, 32), None)]  # the chain: three whole pages
    assert saves[0] == [((11,), None), ((12,), None)]  # the window before page 3
    assert saves[1] == [((22,), None)]  # the state, from the exact block handed off
    (chain,) = [j for j in meta.saves if j.group == 2]
    state = next(j for j in meta.saves if j.group == 1)
    assert state.run.hashes == chain.run.hashes[2:3]
