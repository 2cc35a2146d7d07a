"""What the interop tests build from the engines' own classes: SGLang host pools,
its storage config and its HiCacheController; vLLM's offloading config. Nothing
here re-writes an engine's interface: each helper calls the engine's constructors."""

from __future__ import annotations

import contextlib
import mmap
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed
from sglang.srt.runtime_context import get_parallel
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from fabric.engines.sglang import KvFabricStorage

BACKEND = {
    "backend_name": "kvfabric",
    "module_path": "fabric.engines.sglang",
    "class_name": "KvFabricStorage",
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def host_pool(
    layers: int = 4,
    heads: int = 4,
    head_dim: int = 32,
    page_size: int = 4,
    layout: str = "layer_first",
    dtype: str = "bfloat16",
    tokens: int = 256,
) -> MHATokenToKVPoolHost:
    """SGLang's own MHA host pool on the CPU (not pinned), over a CPU device pool."""
    device = MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=DTYPES[dtype],
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return MHATokenToKVPoolHost(
        device,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
    )


def fill_random(pool: MHATokenToKVPoolHost, host_indices: torch.Tensor, seed: int = 0) -> None:
    """Random KV in the pages that start at ``host_indices`` (every page of them)."""
    gen = torch.Generator().manual_seed(seed)
    t = pool.page_size
    for start in host_indices[::t].tolist():
        page = pool.get_data_page(start, flat=True)
        pool.set_from_flat_data_page(start, torch.randn(page.shape, generator=gen).to(pool.dtype))


def pages_of(pool: MHATokenToKVPoolHost, host_indices: torch.Tensor) -> list[torch.Tensor]:
    """Copies of SGLang's flat data pages at ``host_indices``."""
    return [
        pool.get_data_page(s, flat=True).clone() for s in host_indices[:: pool.page_size].tolist()
    ]


def storage_config(
    tp_rank: int = 0, tp_size: int = 1, model: str | None = "m", **extra: Any
) -> HiCacheStorageConfig:
    """SGLang's storage config, as its controller builds it for one rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config={**BACKEND, "interface_v1": 1, **extra},
    )


def adapter(
    pool: MHATokenToKVPoolHost, tp_rank: int = 0, tp_size: int = 1, model: str = "m", **extra: Any
) -> KvFabricStorage:
    """The backend as SGLang's factory makes it (``cls(storage_config, {})``), given its pool."""
    backend = KvFabricStorage(storage_config(tp_rank, tp_size, model, **extra), {})
    backend.register_mem_pool_host(pool)
    return backend


def sglang_hashes(tokens: list[int], page_size: int, extra_key: str | None = None) -> list[str]:
    """SGLang's own storage chain hashes (its JIT-compiled native hash)."""
    return get_hash_str(tokens, storage_namespace_seed(extra_key, None), page_size=page_size)


def make_controller(
    pool: MHATokenToKVPoolHost, backend: str, extra: dict[str, Any], model: str = "m"
) -> HiCacheController:
    """SGLang's HiCacheController over ``pool`` with storage ``backend`` attached, on one
    rank (TP=PP=1): the threads its backups and prefetches run on are SGLang's own.
    Detach it (``detach_storage_backend``) when done."""

    class Allocator:  # what the controller asks of the device allocator
        def get_kvcache(self) -> MHATokenToKVPool:
            return pool.device_pool

    import torch.distributed as dist

    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        return HiCacheController(
            Allocator(),
            pool,
            pool.page_size,
            dist.group.WORLD,
            threading.Event(),
            storage_backend=backend,
            model_name=model,
            storage_backend_extra_config=extra,
        )


@contextlib.contextmanager
def controller(
    pool: MHATokenToKVPoolHost, backend: str, extra: dict[str, Any], model: str = "m"
) -> Iterator[HiCacheController]:
    """``make_controller``, detached on leaving the block."""
    cc = make_controller(pool, backend, extra, model)
    try:
        yield cc
    finally:
        cc.detach_storage_backend()


def backup(
    cc: HiCacheController, host_indices: torch.Tensor, tokens: list[int], hashes: list[str]
) -> int:
    """What HiRadixCache does to back a node up: ``write_storage``, then wait for the ack."""
    cc.write_storage(host_indices, tokens, hash_value=hashes)
    return cc.ack_backup_queue.get(timeout=30).completed_tokens


def prefetch(cc: HiCacheController, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """What HiRadixCache does for a prefetch: the controller's hit query (its
    ``batch_exists`` calls), then host pages for the hit, then the controller's
    transfer; returns the tokens every ack agreed on and the host indices."""
    cc.prefetch("req", tokens, None)
    op = cc.prefetch_hit_queue.get(timeout=30)
    hit = op.storage_hit_count
    host_indices = cc.mem_pool_host.alloc(hit) if hit else torch.empty(0, dtype=torch.int64)
    if not hit:
        return 0, host_indices
    op.host_indices = host_indices
    cc.prefetch_buffer.put(op)
    completed = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=30)
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.completed_req:
            return completed, host_indices


def offloading_spec(
    model: str = "test-model",
    dtype: str = "float32",
    tp_size: int = 1,
    rank: int = 0,
    events: bool = False,
) -> MagicMock:
    """An offloading spec as vLLM's own tier tests make one: a stand-in object
    carrying vLLM's normalized ``OffloadingConfig``, which is all a tier reads."""
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=events, self_describing_kv_events=False
    )
    return spec


def corrupt_one_payload_byte(store_dir: Path, which: int = 0) -> None:
    """Flip the last byte of the ``which``-th record's payload in the store's
    (only) segment file: the page's checksum no longer holds."""
    (seg,) = sorted(p for p in store_dir.iterdir() if p.name.startswith("seg-"))
    data = bytearray(seg.read_bytes())
    frame = struct.Struct("<4sHI")  # fabric/l3/segment.py's record frame
    at = 0
    for _ in range(which + 1):
        _, key_len, page_len = frame.unpack_from(data, at)
        at += frame.size + key_len + page_len
    data[at - 1] ^= 0xFF
    seg.write_bytes(bytes(data))


def page_aligned(rows: int, floats: int) -> torch.Tensor:
    """A zeroed float32 ``(rows, floats)`` tensor whose memory starts on a page
    boundary, as vLLM's primary tier's is (its fs tier reads with O_DIRECT)."""
    page = mmap.PAGESIZE
    raw = torch.zeros(rows * floats * 4 + page, dtype=torch.uint8)
    shift = -raw.data_ptr() % page
    return raw[shift : shift + rows * floats * 4].view(torch.float32).view(rows, floats)
