"""One kvfabric store for every engine: an SGLang worker (its host pools and
storage config, through ``fabric.engines.sglang``), a Hugging Face driver
(``fabric.engines.hf``), kvfabric's own fabric (its storage actor's logic,
``StorageService``) and a vLLM worker (``fabric.engines.vllm``) find each
other's pages — byte for byte — where model, dtype, layout, TP split, tokens and
namespace agree, and never where one differs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from fabric.cache.keys import TokenKey
from fabric.config import FabricConfig
from fabric.engines.hf import FabricGenerator
from fabric.engines.store import StoreOptions
from fabric.l3.service import StorageService
from fabric.rank.model import assemble, build_model
from fabric.tools.chat import TINY_LLAMA
from fabric.topology import Topology
from tests.interop.support import DTYPES, adapter, host_pool, offloading_spec, sglang_hashes

pytestmark = pytest.mark.interop

LAYERS, HEADS, DIM, PAGE = 4, 2, 64, 4
TOKENS = list(range(500, 524))  # 6 pages
BASE = {"model": "m", "dtype": "bfloat16", "layout": "layer_first", "tp": 1, "tenant": None}
DIFFS = {
    "none": {},
    "model": {"model": "m2"},
    "dtype": {"dtype": "float16"},
    "layout": {"layout": "page_first"},
    "tp": {"tp": 2},
    "tenant": {"tenant": "t2"},
}


def fabric_config(path, s):
    return FabricConfig().with_overrides(
        [
            *TINY_LLAMA,
            f"model.model_id={s['model']}",
            f"model.dtype={s['dtype']}",
            f"model.layout={s['layout']}",
            f"topology.tp={s['tp']}",
            f"cache.page_size={PAGE}",
            f"storage.path={path}",
        ]
    )


def namespace(s) -> str:
    return "sglang" if s["tenant"] is None else f"sglang:{s['tenant']}"


class Fabric:
    """kvfabric's own fabric: what its storage actor does with its ranks' pages."""

    def __init__(self, path, s, model):
        self.config = fabric_config(path, s)
        self.service = StorageService(self.config)
        self.topo = Topology(self.config.topology)
        self.key = TokenKey(TOKENS, PAGE, namespace(s))
        self.dtype = DTYPES[s["dtype"]]

    def _shards(self):
        m = self.config.model
        return [self.topo.shard(i, m, PAGE) for i in range(self.topo.world_size)]

    def write(self, kv):
        hashes = self.key.page_hashes()
        for shard in self._shards():
            mine = kv[:, :, shard.head_start : shard.head_start + shard.heads]  # (2, L, H, T, D)
            pages = mine.permute(0, 3, 1, 2, 4).reshape(
                2, len(hashes), PAGE, LAYERS, shard.heads, DIM
            )
            rows = pages.permute(1, 0, 2, 3, 4, 5).to(self.dtype).contiguous().view(torch.uint8)
            assert self.service.store(
                shard.rank.suffix, hashes, rows.reshape(len(hashes), -1).numpy()
            )

    def hit(self):
        return self.service.query(self.key.page_hashes())

    def read(self):
        hashes = self.key.page_hashes()
        shards = []
        for shard in self._shards():
            rows = self.service.load(shard.rank.suffix, hashes)
            t = (
                torch.from_numpy(rows)
                .view(self.dtype)
                .view(len(hashes), 2, PAGE, LAYERS, shard.heads, DIM)
            )
            shards.append(
                (shard, t.permute(1, 0, 2, 3, 4, 5).reshape(2, -1, LAYERS, shard.heads, DIM))
            )
        return assemble(shards, self.config.model, PAGE, len(TOKENS))


class HF:
    """A Hugging Face driver's ``FabricGenerator`` on the store's directory."""

    def __init__(self, path, s, model):
        model = copy.deepcopy(model).to(DTYPES[s["dtype"]])  # it computes in the fabric's dtype
        self.gen = FabricGenerator(model, fabric_config(path, s), StoreOptions(path=str(path)))
        self.key = TokenKey(TOKENS, PAGE, namespace(s))

    def write(self, kv):
        assert self.gen.put(self.key, kv, 0) == len(TOKENS) // PAGE

    def hit(self):
        return self.gen.cached_pages(self.key)

    def read(self):
        kv, pages = self.gen.load(self.key, self.hit())
        assert pages == len(TOKENS) // PAGE
        return kv


class SGLang:
    """SGLang workers (one per TP rank) with kvfabric as their storage backend."""

    def __init__(self, path, s, model):
        tp = s["tp"]
        self.ranks = []
        for rank in range(tp):
            pool = host_pool(LAYERS, HEADS // tp, DIM, PAGE, s["layout"], s["dtype"])
            backend = adapter(pool, rank, tp, s["model"], path=str(path), kv_heads=HEADS)
            self.ranks.append((pool, backend, pool.alloc(len(TOKENS))))
        self.hashes = sglang_hashes(TOKENS, PAGE, s["tenant"])
        self.layout = s["layout"]

    def _tokens(self, pool, idx):
        kv = pool.kv_buffer  # (2, L, tokens, H, D) or (2, tokens, L, H, D)
        return kv[:, :, idx] if self.layout == "layer_first" else kv[:, idx].transpose(1, 2)

    def write(self, kv):
        for rank, (pool, backend, idx) in enumerate(self.ranks):
            heads = pool.head_num
            mine = kv[:, :, rank * heads : (rank + 1) * heads].permute(0, 1, 3, 2, 4).to(pool.dtype)
            if self.layout == "layer_first":
                pool.kv_buffer[:, :, idx] = mine
            else:
                pool.kv_buffer[:, idx] = mine.transpose(1, 2)
            assert all(backend.batch_set_v1(self.hashes, idx))

    def hit(self):
        return min(backend.batch_exists(self.hashes) for _, backend, _ in self.ranks)

    def read(self):
        parts = []
        for pool, backend, _ in self.ranks:
            dst = pool.alloc(len(TOKENS))
            assert all(backend.batch_get_v1(self.hashes, dst))
            parts.append(self._tokens(pool, dst).permute(0, 1, 3, 2, 4).float())
        return torch.cat(parts, dim=2)


ENGINES = {"fabric": Fabric, "hf": HF, "sglang": SGLang}


@pytest.fixture(scope="module")
def model():
    return build_model(FabricConfig().with_overrides(TINY_LLAMA).model)


def random_kv(dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(2, LAYERS, HEADS, len(TOKENS), DIM, generator=gen).to(DTYPES[dtype]).float()


@pytest.mark.parametrize("diff", list(DIFFS))
@pytest.mark.parametrize("reader", list(ENGINES))
@pytest.mark.parametrize("writer", list(ENGINES))
def test_engines_share_pages_exactly_when_everything_agrees(tmp_path, model, writer, reader, diff):
    kv = random_kv(BASE["dtype"])
    ENGINES[writer](tmp_path, BASE, model).write(kv)
    other = ENGINES[reader](tmp_path, {**BASE, **DIFFS[diff]}, model)
    if diff == "none":
        assert other.hit() == len(TOKENS) // PAGE
        assert torch.equal(other.read(), kv), "the same bytes, whatever engine wrote them"
    else:
        assert other.hit() == 0, f"a {diff} that differs never shares a page"


@pytest.mark.parametrize("reader", list(ENGINES))
def test_a_vllm_workers_chunks_are_nobody_elses_pages(tmp_path, model, reader):
    """vLLM names chunks by its own block hashes: even chunks whose keys carry
    exactly SGLang's page hashes are no page to the other engines."""
    chunk = torch.rand(8, 1024)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvFabricTier", "module_path": "fabric.engines.vllm", "path": str(tmp_path)},
        memoryview(chunk.numpy()),
        offloading_spec(model=BASE["model"], dtype=BASE["dtype"]),
    )
    keys = [make_offload_key(bytes.fromhex(h), 0) for h in sglang_hashes(TOKENS, PAGE)]
    tier.submit_store(TransferJob(1, keys, np.arange(len(keys)), False, None))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    tier.shutdown()
    assert ENGINES[reader](tmp_path, BASE, model).hit() == 0
