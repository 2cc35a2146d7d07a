"""Pools, page copies, the synthetic producer and consensus rules, without Ray."""

import pytest
import torch

from fabric.cache.keys import TokenKey, namespace_seed, pack_tokens
from fabric.config import FabricConfig, ModelConfig
from fabric.coordinator.consensus import Consensus, reduce_max, reduce_min
from fabric.driver.local import LocalFabric
from fabric.errors import InvalidInput
from fabric.messages import Report
from fabric.rank.pools import KVPool, copy_pages, page_runs
from fabric.rank.producer import ConstantKV, SyntheticKV
from fabric.topology import Topology
from tests.helpers import prompt, small_config


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_every_layout_round_trips_pages_through_l2(layout):
    model = ModelConfig(layers=2, kv_heads=2, head_dim=8, layout=layout, dtype="float32")
    shard = Topology(FabricConfig().topology).shard(1, model, 4)
    kv = SyntheticKV(shard, model, 4)
    l1 = KVPool(6, shard, model, torch.device("cpu"))
    l2 = KVPool(6, shard, model, torch.device("cpu"))
    tokens = pack_tokens(range(16))
    kv.fill(l1, "ns", namespace_seed("ns"), tokens, 0, [0, 3, 4, 5])
    copy_pages(l1, [0, 3, 4, 5], l2, [5, 0, 1, 2])  # one scattered page, one run of three
    l1.buffer.zero_()
    copy_pages(l2, [5, 0, 1, 2], l1, [1, 2, 3, 4])
    positions, expected = kv.expected(namespace_seed("ns"), tokens, 0, torch.float32)
    pages, offsets = kv.locate(positions, 0, [1, 2, 3, 4])
    assert torch.equal(l1.read_tokens(pages, offsets), expected)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("head_dim", [8, 2048])  # pages of 512 bytes and of 128 KiB
def test_scattered_pages_of_any_size_land_in_their_slots_in_every_layout(layout, head_dim):
    """Many scattered pages (more runs than are copied one by one when pages are
    small; one strided copy each when they are large): each destination page is
    its source page, and no other slot is touched."""
    model = ModelConfig(layers=2, kv_heads=2, head_dim=head_dim, layout=layout, dtype="float32")
    shard = Topology(FabricConfig().topology).shard(0, model, 4)
    src = KVPool(40, shard, model, torch.device("cpu"))
    dst = KVPool(40, shard, model, torch.device("cpu"))
    src.buffer.copy_(torch.randn(src.buffer.shape))
    dst.buffer.fill_(7.0)
    pages = list(range(0, 40, 2))  # 20 runs
    slots = pages[::-1]
    copy_pages(src, pages, dst, slots)
    for p, s in zip(pages, slots, strict=True):
        assert torch.equal(dst.pages[:, s], src.pages[:, p])
    untouched = sorted(set(range(40)) - set(slots))
    assert bool((dst.pages[:, untouched] == 7.0).all())


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_large_host_copy_shared_among_threads_lands_every_page(layout, monkeypatch):
    """Past ``_SHARED_COPY_BYTES`` the runs of a host copy are split among torch's
    threads: every page still lands in its slot, and nothing else is touched."""
    import fabric.rank.pools as pools

    model = ModelConfig(layers=2, kv_heads=2, head_dim=64, layout=layout, dtype="float32")
    shard = Topology(FabricConfig().topology).shard(0, model, 4)
    src = KVPool(64, shard, model, torch.device("cpu"))
    dst = KVPool(64, shard, model, torch.device("cpu"))
    src.buffer.copy_(torch.randn(src.buffer.shape))
    dst.buffer.fill_(7.0)
    pages = [p for p in range(64) if p % 3]  # 42 runs of one page (the slots reversed)
    slots = pages[::-1]
    monkeypatch.setattr(pools, "_SHARED_COPY_BYTES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        copy_pages(src, pages, dst, slots)
    finally:
        torch.set_num_threads(threads)
    assert 2 in pools._POOLS  # two threads besides the caller's took runs
    for p, s in zip(pages, slots, strict=True):
        assert torch.equal(dst.pages[:, s], src.pages[:, p])
    untouched = sorted(set(range(64)) - set(slots))
    assert bool((dst.pages[:, untouched] == 7.0).all())


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 2048])  # rows by one index copy; by strided runs
def test_pages_leave_and_enter_a_pool_as_canonical_rows_in_every_layout(layout, dtype, head_dim):
    """``rows``/``put_rows`` (L3's byte rows): K/V first, then tokens, layers,
    heads, head_dim, whatever the layout; scattered slots, runs among them, rows
    from a read-only buffer (Ray's object store), no other slot touched."""
    import numpy as np

    model = ModelConfig(layers=2, kv_heads=2, head_dim=head_dim, layout=layout, dtype=dtype)
    shard = Topology(FabricConfig().topology).shard(0, model, 4)
    src = KVPool(12, shard, model, torch.device("cpu"))
    src.buffer.copy_(torch.randn(src.buffer.shape).to(src.buffer.dtype))
    slots = [9, 2, 3, 4, 11, 0]  # a run of three among scattered pages
    rows = src.rows(slots)
    idx = torch.tensor(slots)
    canonical = src.pages[:, idx].permute(1, 0, 2, 3, 4, 5).contiguous()
    assert np.array_equal(rows, canonical.view(torch.uint8).reshape(len(slots), -1).numpy())
    dst = KVPool(12, shard, model, torch.device("cpu"))
    dst.buffer.fill_(7.0)
    read_only = rows.copy()
    read_only.flags.writeable = False
    into = [1, 5, 6, 7, 10, 8]
    dst.put_rows(into, read_only)
    for s, d in zip(slots, into, strict=True):
        assert torch.equal(dst.pages[:, d], src.pages[:, s])
    assert bool((dst.pages[:, [0, 2, 3, 4, 9, 11]] == 7.0).all())


def test_page_runs_merge_contiguous_pairs():
    assert page_runs([1, 2, 3, 7, 8], [4, 5, 6, 0, 1]) == [(1, 4, 3), (7, 0, 2)]
    assert page_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


def _after_first_page(namespace: str, tokens: bytes, page_size: int = 4):
    """The chain hash after the first page, and the tokens after it."""
    return TokenKey(tokens, page_size, namespace).page_hashes()[0], tokens[page_size * 4 :]


@pytest.mark.parametrize("producer", [SyntheticKV, ConstantKV])
def test_producer_depends_on_whole_prefix_layer_head_and_shard(producer):
    model = ModelConfig(layers=2, kv_heads=2, head_dim=8, dtype="float32")
    topo = Topology(FabricConfig().topology)
    a, b = (producer(topo.shard(i, model, 4), model, 4) for i in (0, 1))
    t1 = pack_tokens([1, 2, 3, 4, 5, 6, 7, 8])
    t2 = pack_tokens([9, 2, 3, 4, 5, 6, 7, 8])  # differs only in the first token
    _, v1 = a.expected(*_after_first_page("ns", t1), 4, torch.float32)
    _, v2 = a.expected(*_after_first_page("ns", t2), 4, torch.float32)
    _, v3 = b.expected(*_after_first_page("ns", t1), 4, torch.float32)
    _, v4 = a.expected(*_after_first_page("other", t1), 4, torch.float32)
    assert not torch.equal(v1, v2) and not torch.equal(v1, v3) and not torch.equal(v1, v4)
    _, again = a.expected(*_after_first_page("ns", t1), 4, torch.float32)
    assert torch.equal(v1, again)


@pytest.mark.parametrize("producer", [SyntheticKV, ConstantKV])
def test_a_fill_in_chunks_equals_a_fill_of_the_whole_prompt(producer):
    """A compute carries only its new tokens and the chain hash before them."""
    model = ModelConfig(layers=2, kv_heads=2, head_dim=8, dtype="float32")
    shard = Topology(FabricConfig().topology).shard(1, model, 4)
    kv = producer(shard, model, 4)
    whole, chunked = (KVPool(6, shard, model, torch.device("cpu")) for _ in range(2))
    tokens = pack_tokens(range(100, 120))
    kv.fill(whole, "ns", namespace_seed("ns"), tokens, 0, [0, 1, 2, 3, 4])
    hashes = TokenKey(tokens, 4, "ns").page_hashes()
    kv.fill(chunked, "ns", namespace_seed("ns"), tokens[:32], 0, [0, 1])
    kv.fill(chunked, "ns", hashes[1], tokens[32:48], 8, [2])
    kv.fill(chunked, "ns", hashes[2], tokens[48:], 12, [3, 4])
    assert torch.equal(whole.buffer, chunked.buffer)


def test_context_parallel_ranks_hold_disjoint_token_offsets():
    f = LocalFabric(small_config("topology.cp=2", "topology.pp=1"))
    tokens = pack_tokens(prompt(3, pages=3))
    r = f.serve(tokens)
    assert f.verify(r, tokens) == [True] * 4
    offsets = {w.shard.rank: tuple(w.producer.positions(0, 4).tolist()) for w in f.ranks}
    assert sorted(set(offsets.values())) == [(0, 1), (2, 3)]


def test_consensus_is_min_for_progress_and_max_for_flags():
    c = Consensus(3)
    reports = [
        Report(i, f"inc{i}", 1, done, done + 1, 2, (7,) if i == 2 else ())
        for i, done in enumerate((5, 3, 4))
    ]
    rnd = c.reduce(reports, epoch=1)
    assert (rnd.computes_done, rnd.writes_done, rnd.loads_done) == (3, 4, 2)
    assert rnd.failed == {7}
    assert reduce_min([4, 2, 9]) == 2 and reduce_max([False, True]) and not reduce_max([False])
    restarted = c.reduce([Report(0, "new", 1, 5, 5, 5, ()), *reports[1:]], epoch=1)
    assert restarted.restarted == (0,) and not restarted.usable
    with pytest.raises(InvalidInput, match="one report from each"):
        c.reduce(reports[:2], epoch=1)


def test_config_refuses_shapes_that_do_not_split_over_ranks():
    with pytest.raises(ValueError, match=r"model\.kv_heads=3 .*topology\.tp"):
        FabricConfig.from_dict({"model": {"kv_heads": 3}})
    with pytest.raises(ValueError, match=r"cache\.page_size=4 .*topology\.cp"):
        FabricConfig.from_dict(
            {"cache": {"page_size": 4, "device_tokens": 64}, "topology": {"cp": 3}}
        )


def test_a_fabric_that_computes_nothing_still_serves_checkable_pages():
    """``model.filler=constant`` (the fabric measured apart from KV production):
    pages verify through L1, L2, decode and context parallel ranks; a page of
    another prompt or position does not."""
    f = LocalFabric(small_config("model.filler=constant", "topology.cp=2"))
    prompts = [pack_tokens(prompt(seed, pages=5, shared=2)) for seed in range(8)]
    for tokens in prompts + prompts:
        r = f.serve(tokens)
        assert r.error is None and f.verify(r, tokens) == [True] * 8
        f.core.release(r.lease)
    r = f.serve(prompts[0])
    assert r.device_hit_tokens + r.host_hit_tokens > 0
    more = pack_tokens(range(7))
    assert f.verify(f.append(r.lease, more), prompts[0] + more) == [True] * 8
    r = f.serve(prompts[1])
    assert f.verify(r, prompts[2]) != [True] * 8
    assert all(isinstance(w.filler, ConstantKV) for w in f.ranks)


def test_a_rank_holds_its_reply_until_it_has_news_or_nothing_in_flight():
    """``runtime.round_wait_s``: a round's reply waits for a command to finish
    rather than repeating the same report; with nothing in flight it is at once,
    and a command nobody runs holds it only until the bound."""
    import threading

    f = LocalFabric(small_config("storage.backend=none"))
    rank = f.ranks[0]
    rank.ledger.wait_for_news(30)  # nothing in flight: returns at once (else this test hangs)
    f.core.submit(pack_tokens(prompt(1, pages=2)))
    rank.accept(f.core.next_batch())
    assert rank.ledger.queue, "a compute is queued"
    before = rank.report()
    waiter = threading.Thread(target=rank.ledger.wait_for_news, args=(60,), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "it waits while the compute has not run"
    assert rank.run_one(block=False)
    waiter.join(30)
    assert not waiter.is_alive(), "the finished compute is news"
    assert rank.report() != before
    f.core.submit(pack_tokens(prompt(2, pages=2)))
    rank.accept(f.core.next_batch())
    rank.ledger.wait_for_news(0.01)  # nobody runs it: the bound ends the wait
    assert rank.ledger.queue


def test_a_settling_reply_waits_past_news_for_the_rest_of_its_steps_computes():
    """``settle_s``: news of one compute does not end the wait while another
    is queued — the reply waits for it (so it needs no round of its own),
    within ``settle_s``; without ``settle_s`` the first news ends it. Writes
    (no result waits on them) do not hold it."""
    import threading

    f = LocalFabric(small_config("storage.backend=none"))
    rank = f.ranks[0]
    for i in (1, 2):
        f.core.submit(pack_tokens(prompt(i, pages=2)))
    batch = f.core.next_batch()
    kinds = [type(c).__name__ for c in batch.commands]
    assert kinds == ["Compute", "Compute", "Write", "Write"], kinds
    assert rank.accept(batch) == 4 and rank.ledger.awaited == 2
    assert rank.accept(batch) == 0, "a command seen before is not new"

    def waiter(**settle) -> threading.Thread:
        thread = threading.Thread(
            target=rank.ledger.wait_for_news,
            args=(60,),
            kwargs={"since": rank.ledger.news_seq, **settle},
            daemon=True,
        )
        thread.start()
        return thread

    plain, settling = waiter(), waiter(settle_s=60)
    assert rank.run_one(block=False)  # the first compute: news
    plain.join(30)
    assert not plain.is_alive(), "without settle_s the first news ends the wait"
    settling.join(0.2)
    assert settling.is_alive(), "with settle_s it waits for the second compute"
    assert rank.run_one(block=False)  # the second compute
    settling.join(30)
    assert not settling.is_alive(), "no compute left: the reply goes"
    assert [type(c).__name__ for c in rank.ledger.queue] == ["Write", "Write"]
    assert rank.ledger.awaited == 0
    rank.run_pending()
    f.core.submit(pack_tokens(prompt(3, pages=2)))
    f.core.submit(pack_tokens(prompt(4, pages=2)))
    rank.accept(f.core.next_batch())
    bounded = waiter(settle_s=0.05)
    assert rank.run_one(block=False)  # news, and a compute still queued that nobody runs
    bounded.join(30)
    assert not bounded.is_alive(), "settle_s bounds the wait past the news"
    assert rank.ledger.awaited == 1
