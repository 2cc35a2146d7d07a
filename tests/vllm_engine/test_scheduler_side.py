"""The connector's scheduler side without an engine: one coordinator call per step
for every request added before it, hits cut to whole blocks before the last token,
stores planned once per completed block, the L3 fallback and reports, with a
fake link in place of Ray and requests shaped as vLLM's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import DirectStore, StoreOptions, parse_options
from fabric.engines.vllm_pages import ConnectorOptions, FabricWorkerMeta, request_namespace
from fabric.engines.vllm_scheduler import SchedulerSide
from fabric.errors import ConfigError
from fabric.l3.format import Provenance, page_key

pytestmark = pytest.mark.vllm

BLOCK = 4
TAG = "0123456789abcdef"
SUFFIXES = ["0-0-0", "0-0-1"]


class FakeLink:
    """A fabric that answers every chain with ``hits`` pages (or is down)."""

    def __init__(self, hits: int = 0, up: bool = True, store: StoreOptions | None = None):
        self.hits = hits
        self.up = up
        self.store = store
        self.asked: list[list[list[bytes]]] = []
        self.reports: list[dict] = []
        self.forgotten: list[bytes] = []
        self.leases: list[tuple[list[str], float, list[str]]] = []

    def ask(self, tag, world, chains, leases=None, lease_s=0.0, release=None):
        self.asked.append(chains)
        self.leases.append((leases, lease_s, release))
        return len(self.asked)

    def answer(self, handle):
        return [min(self.hits, len(c)) for c in self.asked[handle - 1]]

    def report(self, tag, world, stored):
        self.reports.append(stored)

    def forget(self, tag, world, hashes):
        self.forgotten += hashes


def request(rid: str, tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        all_token_ids=list(tokens),
        lora_request=None,
        cache_salt=salt,
        mm_features=[],
    )


def output(new=(), cached=None, scheduled=None) -> SimpleNamespace:
    cached = cached or SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled or {},
    )  # fmt: skip


def new_req(rid: str, blocks: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)


def side(link: FakeLink, **options) -> SchedulerSide:
    return SchedulerSide(ConnectorOptions(**options), TAG, SUFFIXES, BLOCK, link)


def test_every_request_added_before_a_step_is_asked_in_one_call():
    link = FakeLink(hits=2)
    s = side(link)
    reqs = [request(f"r{i}", list(range(i, i + 13))) for i in range(3)]
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
    late = request("late", list(range(9)))
    assert s.matched(late, 0) == (2 * BLOCK, False)
    assert len(link.asked) == 2


def test_the_last_token_is_always_computed():
    link = FakeLink(hits=99)
    s = side(link)
    r = request("r", list(range(12)))  # exactly 3 blocks: 2 may load
    assert s.matched(r, 0) == (2 * BLOCK, False)


def test_a_hit_loads_into_its_blocks_and_only_new_whole_blocks_are_stored_once():
    link = FakeLink(hits=2)
    s = side(link)
    r = request("r", list(range(14)))
    s.new_request(r)
    assert s.matched(r, 0) == (8, False)
    s.allocated(r, None, 8)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    (load,) = meta.loads
    assert load.block_ids == (10, 11) and not load.asynchronous
    (save,) = meta.saves  # tokens 8..13 computed: block 2 is whole, block 3 is not
    assert save.block_ids == (12,) and save.run.parent == load.hashes[-1]
    first = save.run.hashes[0]
    # A decode step that completes block 3 stores it, and nothing else.
    r.all_token_ids += [50, 51]
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[14]
    )
    meta = s.step_meta(output(cached=cached, scheduled={"r": 2}))
    (save,) = meta.saves
    assert save.block_ids == (13,) and not meta.loads
    meta = s.step_meta(output(cached=cached, scheduled={"r": 1}))
    assert not meta.saves
    # The engine keeps stepping until every rank reported both stores ended, and
    # a request sharing a page still being stored waits for it (asks again).
    last = save.run.hashes[0]
    assert s.pending_writes()
    twin = request("twin", [*range(14), 50, 51, 52])
    s.new_request(twin)
    assert s.matched(twin, 0) == (None, False)
    s.worker_output(FabricWorkerMeta({0: [save.run]}, {}, {0: [first, last], 1: [first]}))
    assert s.pending_writes()
    assert s.matched(twin, 0) == (None, False)
    s.worker_output(FabricWorkerMeta({}, {}, {1: [last]}))
    assert not s.pending_writes()
    assert link.reports[0] == {0: [save.run]}
    link.hits = 4
    assert s.matched(twin, 0) == (4 * BLOCK, False)


def test_asynchronous_loads_start_from_the_blocks_vllm_allocated():
    link = FakeLink(hits=3)
    s = side(link, load_async=True)
    r = request("r", list(range(20)))
    s.new_request(r)
    assert s.matched(r, 0) == (12, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10, 11],))
    s.allocated(r, blocks, 12)
    (load,) = s.step_meta(output()).loads  # the request itself is not scheduled
    assert load.asynchronous and load.block_ids == (7, 8, 9)


def test_a_resumed_request_takes_its_new_blocks():
    link = FakeLink(hits=0)
    s = side(link)
    r = request("r", list(range(9)))
    assert s.matched(r, 0) == (0, False)
    s.step_meta(output([new_req("r", [1, 2, 3])], scheduled={"r": 4}))
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([5, 6, 7],)], num_computed_tokens=[4]
    )
    (save,) = s.step_meta(output(cached=cached, scheduled={"r": 5})).saves
    assert save.block_ids == (6,)


def test_cache_salts_and_tenants_get_chains_of_their_own():
    link = FakeLink()
    s = side(link)
    tokens = list(range(9))
    reqs = [request(rid, tokens, salt) for rid, salt in (("a", None), ("b", "s"), ("c", "t"))]
    for r in reqs:
        s.new_request(r)
    s.matched(reqs[0], 0)
    (chains,) = link.asked
    assert len({c[0] for c in chains}) == 3
    assert request_namespace("t", None, None) == "t"
    assert request_namespace("t", "s", None) != request_namespace("t", None, "s")


def test_a_down_fabric_answers_from_the_store_alone(tmp_path):
    options = StoreOptions(path=str(tmp_path))
    link = FakeLink(up=False, store=options)
    s = side(link)
    r = request("r", list(range(17)))  # 4 whole blocks before the last token
    hashes = _chain(s, r)
    provenance = Provenance("m", "vllm-block/x", "uint8", (1,), BLOCK)
    store = DirectStore(options, "vllm")
    rows = np.zeros((3, 8), dtype=np.uint8)
    # Both shards of pages 0 and 1; page 2 for one shard only.
    store.store([page_key(h, TAG, "0-0-0") for h in hashes[:3]], rows, provenance)
    store.store([page_key(h, TAG, "0-0-1") for h in hashes[:2]], rows[:2], provenance)
    store.close()
    assert s.matched(r, 0) == (2 * BLOCK, False)
    assert link.asked == [] and link.reports == []
    s.close()


def test_the_store_extends_the_fabrics_answer_and_the_fabric_is_told(tmp_path):
    options = StoreOptions(path=str(tmp_path))
    link = FakeLink(hits=1, store=options)
    s = side(link)
    r = request("r", list(range(17)))
    hashes = _chain(s, r)
    provenance = Provenance("m", "vllm-block/x", "uint8", (1,), BLOCK)
    store = DirectStore(options, "vllm")
    for suffix in SUFFIXES:
        store.store(
            [page_key(h, TAG, suffix) for h in hashes[1:3]], np.zeros((2, 8), np.uint8), provenance
        )
    store.close()
    assert s.matched(r, 0) == (3 * BLOCK, False)
    (report,) = link.reports
    assert report == {rank: [StoredRun("vllm", hashes[0], tuple(hashes[1:3]))] for rank in (0, 1)}
    # A page a worker failed to load is not found in the store again.
    s.worker_output(FabricWorkerMeta({}, {1: [hashes[1]]}))
    assert link.forgotten == [hashes[1]]
    assert s.matched(request("r2", list(range(17))), 0) == (BLOCK, False)
    s.close()


def _chain(s: SchedulerSide, r: SimpleNamespace) -> list[bytes]:
    state = s._track(r)
    s._hashes_to(state, (len(r.prompt_token_ids) - 1) // BLOCK)
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


def test_matched_pages_are_leased_until_loaded_and_released_with_the_next_call():
    link = FakeLink(hits=2)
    s = side(link, lease_s=7.0)
    r, miss = request("r", list(range(14))), request("m", list(range(100, 114)))
    s.new_request(r)
    s.new_request(miss)
    assert s.matched(r, 0) == (8, False)
    (names, lease_s, release) = link.leases[0]
    assert lease_s == 7.0 and release == [] and len(names) == 2
    assert names[0].endswith("/r") and names[1].endswith("/m")
    s.allocated(r, None, 8)
    meta = s.step_meta(output([new_req("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    assert len(meta.loads) == 1
    s.worker_output(None)  # the step that loaded ran: its lease ends
    s.new_request(request("next", list(range(200, 214))))
    s.matched(request("next", list(range(200, 214))), 0)
    assert link.leases[1][2] == [names[0]]
    # A request whose loads ran asynchronously releases when vLLM says it is done.
    link2 = FakeLink(hits=2)
    s2 = side(link2, load_async=True)
    a = request("a", list(range(14)))
    s2.new_request(a)
    assert s2.matched(a, 0) == (8, True)
    s2.allocated(a, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 8)
    s2.step_meta(output())
    s2.worker_output(None, {"a"})
    s2.matched(request("b", list(range(300, 314))), 0)
    assert link2.leases[1][2] == [link2.leases[0][0][0]]


def test_a_finished_request_releases_a_lease_never_loaded_and_no_lease_is_taken_at_zero():
    link = FakeLink(hits=2)
    s = side(link)
    r = request("r", list(range(14)))
    s.matched(r, 0)
    s.finished(r)  # aborted before it was scheduled
    s.matched(request("n", list(range(50, 64))), 0)
    assert link.leases[1][2] == [link.leases[0][0][0]]
    off = FakeLink(hits=2)
    s0 = side(off, lease_s=0)
    s0.matched(request("r", list(range(14))), 0)
    s0.finished(request("r", []))
    s0.matched(request("n", list(range(50, 64))), 0)
    assert off.leases[0][1] == 0 and off.leases[1][2] == []
