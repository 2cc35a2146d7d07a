"""What a rank is made of, from its config: its pools (one L1 and one L2 per
component) and the filler that computes KV into them."""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from fabric.config import FabricConfig
from fabric.rank.pools import KVPool, RankPools, StatePool
from fabric.rank.producer import ConstantKV, KVFiller, SyntheticKV
from fabric.rank.shared_l2 import SharedL2
from fabric.topology import Shard, kind_layers

log = logging.getLogger(__name__)


def build_pools(
    config: FabricConfig, shard: Shard, device: torch.device, l2_path: str | None
) -> tuple[RankPools, SharedL2 | None]:
    """The pools by component: the full-attention layers' (every layer's, for a
    full-attention model), and a hybrid model's sliding and mamba ones; L1 on
    ``device``, L2 in host memory (pinned where the device is a GPU). With
    ``l2_path``, a full-attention model's L2 lies in that shared-memory file
    (``fabric.rank.shared_l2``) and the file comes back too; a hybrid model's
    L2 stays in process (without its other pools its pages could not be
    adopted anyway)."""
    cache, model = config.cache, config.model
    host, cuda = torch.device("cpu"), device.type == "cuda"
    pools, shared_l2 = RankPools(), None

    def kv_pools(component: str, l1_pages: int, l2_pages: int) -> None:
        layers = len(kind_layers(shard, model, component))
        pools.add(
            component,
            KVPool(l1_pages, shard, model, device, layers=layers),
            KVPool(l2_pages, shard, model, host, pin_memory=cuda, layers=layers),
        )

    if l2_path is None or set(model.components) != {"full"}:
        kv_pools("full", cache.device_pages, cache.host_pages)
    else:
        shared_l2 = _shared_l2_pools(pools, config, shard, device, l2_path)
    if "sliding" in model.components:
        kv_pools("sliding", cache.sliding_pages, cache.host_sliding_pages)
    if "mamba" in model.components:
        layers, elems = (
            len(kind_layers(shard, model, "mamba")),
            model.mamba_elems(config.topology.tp),
        )
        pools.add(
            "mamba",
            StatePool(cache.mamba_slots, layers, elems, device),
            StatePool(cache.host_mamba_slots, layers, elems, host),
        )
    return pools, shared_l2


def _shared_l2_pools(
    pools: RankPools, config: FabricConfig, shard: Shard, device: torch.device, path: str
) -> SharedL2 | None:
    """Add the full-attention pools with L2 in the shared-memory file ``path`` (in
    process, with a warning, where the file cannot be had)."""
    cache, model = config.cache, config.model
    layers = len(kind_layers(shard, model, "full"))
    shared_l2: SharedL2 | None = None

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nonlocal shared_l2
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        geometry = {
            "shape": list(shape),
            "dtype": str(dtype),
            "pool_bytes": nbytes,
            "page_size": cache.page_size,
            "shard": shard.rank.suffix,
            "layout": model.layout,
        }
        try:
            shared_l2 = SharedL2(path, geometry, cache.host_pages, cache.page_size * 4)
        except OSError as exc:  # too little shared memory, or not ours
            log.warning("rank %s: L2 in this process, not %s: %s", shard.rank, path, exc)
            return torch.zeros(shape, dtype=dtype)
        return torch.frombuffer(shared_l2.pool, dtype=dtype, count=numel).view(shape)

    l2 = KVPool(
        cache.host_pages, shard, model, torch.device("cpu"), layers=layers, allocate=allocate
    )
    pools.add("full", KVPool(cache.device_pages, shard, model, device, layers=layers), l2)
    if device.type == "cuda":  # page-locked for the copy engines, as a pinned pool would be
        with contextlib.suppress(Exception):
            buf = l2.buffer
            torch.cuda.cudart().cudaHostRegister(
                buf.data_ptr(), buf.numel() * buf.element_size(), 0
            )
    return shared_l2


def build_filler(
    config: FabricConfig, shard: Shard, pools: RankPools, given: KVFiller | None
) -> tuple[KVFiller, SyntheticKV]:
    """The rank's filler (``given``, else the one ``model.filler`` names) and the
    synthetic producer of its full-attention layers (the default filler, and
    where a rank's token positions come from), on the device of ``pools`` (the
    rank's); a hybrid filler gets its L1 mamba slots: it forks cached states."""
    model, page_size = config.model, config.cache.page_size
    device = pools["full"].device.buffer.device
    producer = SyntheticKV(shard, model, page_size, kind_layers(shard, model, "full"))
    if given is not None:
        return given, producer
    if model.filler == "constant":
        return ConstantKV(shard, model, page_size), producer
    if model.filler == "llama":
        from fabric.rank.sharded import ShardedLlamaKV  # transformers: an optional extra

        return ShardedLlamaKV(shard, model, page_size, config.topology, device), producer
    if model.filler == "hybrid":
        from fabric.rank.hybrid import HybridKV  # transformers: an optional extra

        elems = model.mamba_elems(config.topology.tp)
        kv = HybridKV(shard, model, page_size, elems, config.topology.tp)
        kv.attach(pools.device("mamba"), pools.device("sliding"))
        return kv, producer
    return producer, producer
