"""kvfabric as SGLang's HiCache storage backend, driven by SGLang 0.5.20's own
HiCacheController (its backup and prefetch threads, its hit query, its
``interface_v1`` switch) over its own MHA host pools on the CPU.

Not run here: SGLang's device <-> host copies (``transfer_kv_*`` kernels need
CUDA); the storage side, which is this backend's, runs whole."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import torch.distributed as dist
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from fabric.cache.keys import chain_hashes, namespace_seed, pack_tokens
from fabric.engines.sglang import KvFabricStorage
from fabric.errors import ConfigError
from tests.interop.support import (
    BACKEND,
    adapter,
    backup,
    controller,
    corrupt_one_payload_byte,
    fill_random,
    host_pool,
    pages_of,
    prefetch,
    sglang_hashes,
    storage_config,
)

pytestmark = pytest.mark.interop

TOKENS = list(range(1000, 1032))  # 8 pages of 4


@pytest.fixture(scope="module", autouse=True)
def gloo():
    """The single-process gloo group SGLang's controller reduces over (TP=1)."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def test_sglang_chain_hashes_are_kvfabric_chains_in_the_sglang_namespaces():
    packed = pack_tokens(TOKENS)
    mine = [h.hex() for h in chain_hashes(namespace_seed("sglang"), packed, 16)]
    assert sglang_hashes(TOKENS, 4) == mine
    seeded = [h.hex() for h in chain_hashes(namespace_seed("sglang:tenant-a"), packed, 16)]
    assert sglang_hashes(TOKENS, 4, "tenant-a") == seeded
    assert seeded != mine


@pytest.mark.parametrize("interface_v1", [0, 1])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_backed_up_by_sglang_come_back_byte_identical(tmp_path, layout, interface_v1):
    pool = host_pool(layout=layout)
    extra = {**BACKEND, "interface_v1": interface_v1, "path": str(tmp_path)}
    with controller(pool, "dynamic", extra) as cc:
        assert isinstance(cc.storage_backend, KvFabricStorage)
        want_get = "_page_get_zero_copy" if interface_v1 else "_generic_page_get"
        assert cc.page_get_func.__name__ == want_get
        src = pool.alloc(len(TOKENS))
        fill_random(pool, src)
        before = pages_of(pool, src)
        assert backup(cc, src, TOKENS, sglang_hashes(TOKENS, 4)) == len(TOKENS)
        got, dst = prefetch(cc, TOKENS)
        assert got == len(TOKENS)
        assert all(torch.equal(a, b) for a, b in zip(before, pages_of(pool, dst), strict=True))
        metrics = cc.storage_backend.get_stats()
        assert metrics.backup_pgs == [8] and sum(metrics.prefetch_pgs) == 8


@pytest.mark.parametrize("interface_v1", [0, 1])
def test_a_page_corrupted_in_l3_shortens_the_hit(tmp_path, interface_v1):
    pool = host_pool()
    extra = {**BACKEND, "interface_v1": interface_v1, "path": str(tmp_path)}
    with controller(pool, "dynamic", extra) as cc:
        src = pool.alloc(len(TOKENS))
        fill_random(pool, src)
        before = pages_of(pool, src)
        backup(cc, src, TOKENS, sglang_hashes(TOKENS, 4))
        corrupt_one_payload_byte(tmp_path, which=3)
        got, dst = prefetch(cc, TOKENS)
        assert got == 3 * 4, "the pages before the corrupt one, and nothing after"
        assert all(
            torch.equal(a, b) for a, b in zip(before[:3], pages_of(pool, dst)[:3], strict=True)
        )
        assert cc.storage_backend.store.stats()["l3"]["refused_checksum"] == 1


def test_a_valid_page_copied_under_another_key_is_refused(tmp_path):
    """A page copied under another page's key (as any writer of a shared store
    could) is a miss: its header names the key it was written for."""
    pool = host_pool()
    backend = adapter(pool, path=str(tmp_path), backend="file")
    src = pool.alloc(4)
    fill_random(pool, src)
    hashes, other = sglang_hashes(TOKENS[:4], 4), sglang_hashes(TOKENS[4:8], 4)
    assert backend.batch_set_v1(hashes, src) == [True]
    pages = backend.pools[PoolName.KV]
    (key,), (forged,) = backend._keys(pages, hashes), backend._keys(pages, other)
    (tmp_path / forged[:2]).mkdir(mode=0o700, exist_ok=True)
    (tmp_path / forged[:2] / f"{forged}.kv").write_bytes(
        (tmp_path / key[:2] / f"{key}.kv").read_bytes()
    )
    assert backend.batch_exists(other) == 1, "it exists (unverified)"
    assert backend.batch_get_v1(other, pool.alloc(4)) == [False], "but it is never served"
    assert backend.store.backend.stats()["refused_key"] == 1


def test_keys_that_are_not_page_hashes_are_misses(tmp_path):
    pool = host_pool()
    backend = adapter(pool, path=str(tmp_path))
    src = pool.alloc(4)
    fill_random(pool, src)
    assert backend.batch_exists(["../../etc/passwd", "x" * 64]) == 0
    assert backend.batch_get_v1(["not-a-hash"], src) == [False]
    assert backend.batch_set_v1(["NOT HEX"], src) == [False]
    assert backend.get("zz", pool.get_dummy_flat_data_page()) is None
    assert backend.exists("0" * 63) is False


def test_a_tenant_namespace_keeps_pages_apart(tmp_path):
    pool = host_pool()
    hashes = sglang_hashes(TOKENS[:8], 4)
    src = pool.alloc(8)
    fill_random(pool, src)
    a = adapter(pool, path=str(tmp_path), namespace="tenant-a")
    assert a.batch_set_v1(hashes, src) == [True, True]
    assert adapter(pool, path=str(tmp_path), namespace="tenant-a").batch_exists(hashes) == 2
    assert adapter(pool, path=str(tmp_path), namespace="tenant-b").batch_exists(hashes) == 0
    assert adapter(pool, path=str(tmp_path)).batch_exists(hashes) == 0


def test_the_v2_interface_maps_pools_onto_components(tmp_path):
    """A hybrid model's extra pool (here SGLang's MHA host pool registered as the
    SWA pool) is stored beside the KV pages under a component of its own; the
    hit policies shorten the hit where that pool's pages are missing."""
    kv, swa = host_pool(), host_pool(layers=2)
    backend = adapter(kv, path=str(tmp_path))
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    hashes = sglang_hashes(TOKENS[:16], 4)  # 4 pages
    kv_idx, swa_idx = kv.alloc(16), swa.alloc(16)
    fill_random(kv, kv_idx, seed=1)
    fill_random(swa, swa_idx, seed=2)
    wrote = backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=kv_idx, keys=hashes),
            PoolTransfer(name=PoolName.SWA, host_indices=swa_idx[4:12], keys=hashes[1:3]),
        ]
    )
    assert wrote == {PoolName.KV: [True] * 4, PoolName.SWA: [True, True]}
    trailing = backend.batch_exists_v2(
        hashes,
        [
            PoolTransfer(
                name=PoolName.SWA, keys=hashes[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES
            )
        ],
    )
    assert trailing.kv_hit_pages == 3, "the deepest end whose 2-page window SWA holds"
    every = backend.batch_exists_v2(
        hashes, [PoolTransfer(name=PoolName.SWA, keys=hashes, hit_policy=PoolHitPolicy.ALL_PAGES)]
    )
    assert every.kv_hit_pages == 0, "SWA lacks page 0"
    swa_before = pages_of(swa, swa_idx[4:12])
    dst = swa.alloc(8)
    got = backend.batch_get_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=hashes[1:3])]
    )
    assert got == {PoolName.SWA: [True, True]}
    assert all(torch.equal(a, b) for a, b in zip(swa_before, pages_of(swa, dst), strict=True))
    comps = {row["component"] for row in backend.store.backend.usage_by_writer()}
    assert comps == {"full", "sglang-swa"}


def test_sglang_loads_the_backend_through_its_factory_and_options_are_checked(tmp_path, caplog):
    config = storage_config(path=str(tmp_path), tp_lcm_size=None)
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(backend, KvFabricStorage)
    with pytest.raises(ConfigError, match="exactly one of path"):
        KvFabricStorage(storage_config(), {})
    with pytest.raises(ConfigError, match="max_bytes=-1"):
        KvFabricStorage(storage_config(path=str(tmp_path), max_bytes=-1), {})
    with pytest.raises(ConfigError, match="namespace='sglang'"):
        KvFabricStorage(storage_config(path=str(tmp_path), namespace="sglang"), {})
    with pytest.raises(ConfigError, match="no model id"):
        KvFabricStorage(storage_config(model=None, path=str(tmp_path)), {})
    with caplog.at_level(logging.WARNING):
        KvFabricStorage(storage_config(path=str(tmp_path), pathh="/x"), {})
    assert "['pathh'] are not its own" in caplog.text


def test_one_kv_head_per_tp_rank_needs_the_model_head_count(tmp_path):
    pool = host_pool(heads=1)
    with pytest.raises(ConfigError, match="set kv_heads"):
        adapter(pool, tp_rank=1, tp_size=2, path=str(tmp_path))
    # Two KV heads over four ranks: ranks 0, 1 hold head 0 and share its pages.
    hashes = sglang_hashes(TOKENS[:4], 4)
    src = pool.alloc(4)
    fill_random(pool, src)
    r0 = adapter(pool, tp_rank=0, tp_size=4, path=str(tmp_path), kv_heads=2)
    assert r0.batch_set_v1(hashes, src) == [True]
    assert (
        adapter(pool, tp_rank=1, tp_size=4, path=str(tmp_path), kv_heads=2).batch_exists(hashes)
        == 1
    )
    assert (
        adapter(pool, tp_rank=2, tp_size=4, path=str(tmp_path), kv_heads=2).batch_exists(hashes)
        == 0
    )


@pytest.mark.parametrize(
    ("heads", "tp", "kv_heads", "says"),
    [
        (2, 4, 2, "means 1 KV heads per rank, but this rank's host pool holds 2"),
        (1, 4, 8, "means 2 KV heads per rank, but this rank's host pool holds 1"),
        (4, 2, 4, "means 2 KV heads per rank, but this rank's host pool holds 4"),
        (2, 4, 6, "kv_heads=6 is refused: with 4 TP ranks allowed is a multiple"),
    ],
)
def test_a_declared_head_count_that_is_not_the_pools_is_refused_naming_both(
    tmp_path, heads, tp, kv_heads, says
):
    """E.g. each rank's pool holds two heads at TP=4 but kv_heads says 2 (one each,
    replicated): ranks 0 and 1 would store their different heads under one key."""
    pool = host_pool(heads=heads)
    with pytest.raises(ConfigError, match=says):
        adapter(pool, tp_rank=1, tp_size=tp, path=str(tmp_path), kv_heads=kv_heads)


def test_clear_is_refused_unless_allowed(tmp_path):
    pool = host_pool()
    src = pool.alloc(4)
    fill_random(pool, src)
    hashes = sglang_hashes(TOKENS[:4], 4)
    backend = adapter(pool, path=str(tmp_path))
    backend.batch_set_v1(hashes, src)
    assert backend.clear() is False and backend.batch_exists(hashes) == 1
    allowed = adapter(pool, path=str(tmp_path), clear_store=True)
    assert allowed.clear() is True and allowed.batch_exists(hashes) == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_pages_in_slots_that_do_not_follow_one_another(tmp_path, layout):
    pool = host_pool(layout=layout)
    backend = adapter(pool, path=str(tmp_path))
    slots = pool.alloc(64)
    src = torch.cat([slots[i * 4 : i * 4 + 4] for i in (0, 1, 5, 2, 9)])  # runs of 2, 1, 1, 1
    dst = torch.cat([slots[i * 4 : i * 4 + 4] for i in (15, 14, 12, 13, 3)])
    fill_random(pool, src)
    before = pages_of(pool, src)
    hashes = sglang_hashes(TOKENS[:20], 4)
    assert backend.batch_set_v1(hashes, src) == [True] * 5
    assert backend.batch_get_v1(hashes, dst) == [True] * 5
    assert all(torch.equal(a, b) for a, b in zip(before, pages_of(pool, dst), strict=True))
