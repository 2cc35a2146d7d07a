"""What a vLLM engine attached through ``KvFabricConnector`` and the fabric agree
on: the connector's options, the provenance and keys of its pages, and the
messages between its scheduler side and its workers.

One fabric page is one vLLM block of one rank: every layer's KV of the block's
tokens, for the KV heads that rank holds (TP) in the layers of its stage (PP).
Pages are named by kvfabric's own chain hash over the block's tokens, seeded by
the namespace (``fabric.cache.keys``): the tenant the connector serves, with the
request's cache salt and LoRA adapter folded in, so requests that must not share
KV never share a key. The provenance names everything that makes a block's
bytes what they are — model, dtype, block size, layers, heads and head size per
rank, the TP/PP split, vLLM's version, the device and attention backend (the
block's layout in memory) — so engines share pages exactly when those agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from fabric.cache.keys import MAX_NAMESPACE_CHARS, check_namespace
from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import StoreOptions
from fabric.errors import ConfigError
from fabric.l3.format import Provenance


class ConnectorOptions(BaseModel):
    """``kv_connector_extra_config`` of ``KvFabricConnector``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    fabric: str = Field("kvfabric", min_length=1, description="the fabric's runtime.name")
    address: str = Field(
        "auto", min_length=1, description="the Ray cluster the fabric runs on (auto, HOST:PORT)"
    )
    ray_namespace: str = Field("kvfabric", min_length=1, description="the fabric's Ray namespace")
    namespace: str = Field(
        "vllm", min_length=1, max_length=64, description="the kvfabric tenant of this engine"
    )
    path: str = Field(
        "",
        description="the L3 directory the workers read and write (empty: the fabric's "
        "storage.path, as the fabric reports it)",
    )
    timeout_s: float = Field(5.0, gt=0, le=300, description="a number in (0, 300]")
    lease_s: float = Field(
        30.0,
        ge=0,
        le=600,
        description="seconds the fabric holds a request's matched pages for it at most while "
        "they load (released as soon as they are loaded; 0: no lease)",
    )
    retry_s: float = Field(
        10.0, gt=0, le=3600, description="seconds before a fabric that failed is tried again"
    )
    l2_bytes: int = Field(
        1 << 30,
        ge=0,
        le=1 << 40,
        description="bytes of the node's shared memory each worker's shard of pages may hold "
        "(shared by every engine on the node attached to the same fabric; 0: no node L2)",
    )
    l2_dir: str = Field(
        "", description="where the node L2 lives (empty: /dev/shm, the node's shared memory)"
    )
    load_async: bool = Field(
        False,
        description="true: a hit is read on a worker thread while the engine steps on "
        "(the request waits for it); false: read before the step's forward",
    )


@dataclass(frozen=True)
class Placement:
    """This engine's split and where a worker sits in it."""

    tp_size: int
    pp_size: int
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """The worker's index among the engine's ranks, as ``EnginePages`` counts them."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def suffix(self) -> str:
        return f"{self.pp_rank}-0-{self.tp_rank}"

    def suffixes(self) -> list[str]:
        """Every rank's key suffix, in rank order."""
        return [f"{pp}-0-{tp}" for pp in range(self.pp_size) for tp in range(self.tp_size)]


def placement_of(vllm_config: Any) -> Placement:
    parallel = vllm_config.parallel_config
    if (
        getattr(parallel, "prefill_context_parallel_size", 1) > 1
        or getattr(parallel, "decode_context_parallel_size", 1) > 1
    ):
        raise ConfigError(
            "KvFabricConnector: context parallelism is refused (prefill or decode context "
            "parallel size > 1): a page is one rank's whole block"
        )
    return Placement(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)


def attention_group(kv_cache_config: Any) -> Any:
    """The one KV cache group the connector serves; ``ConfigError`` naming what
    is there when the model has several (hybrid models) or none."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not hasattr(groups[0].kv_cache_spec, "num_kv_heads"):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ConfigError(
            f"KvFabricConnector serves models with one full-attention KV cache group; "
            f"this one has {kinds}"
        )
    spec = groups[0].kv_cache_spec
    if getattr(spec, "sliding_window", None) or getattr(spec, "use_mla", False):
        raise ConfigError(
            f"KvFabricConnector serves full attention with separate K and V; "
            f"this model's KV cache is {type(spec).__name__}"
        )
    return groups[0]


def page_provenance(vllm_config: Any, kv_cache_config: Any) -> Provenance:
    """The provenance of every page this engine's ranks store (the same on each:
    the shard is in the key's suffix)."""
    import vllm
    from vllm.platforms import current_platform

    group = attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    parallel = vllm_config.parallel_config
    dtype = str(spec.dtype).removeprefix("torch.")
    head_v = spec.head_size_v or spec.head_size
    identity = {
        "vllm": vllm.__version__,
        "device": current_platform.device_type,
        "attention_backend": str(vllm_config.attention_config.backend),
        "cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
        "layers": list(group.layer_names),
        "head_size_v": head_v,
        "kv_quant": str(getattr(spec, "kv_quant_mode", "")),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return Provenance(
        model_id=str(vllm_config.model_config.model),
        layout=f"vllm-block/{digest}",
        dtype=dtype,
        shard_shape=(len(group.layer_names), spec.num_kv_heads, spec.block_size, spec.head_size),
        page_size=spec.block_size,
    )


def block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block of one layer on one rank, as the KV cache spec sizes it."""
    spec = attention_group(kv_cache_config).kv_cache_spec
    head_v = spec.head_size_v or spec.head_size
    itemsize = spec.dtype.itemsize
    return spec.num_kv_heads * spec.block_size * (spec.head_size + head_v) * itemsize


def request_namespace(tenant: str, cache_salt: str | None, lora_name: str | None) -> str:
    """The kvfabric namespace of a request's pages: the tenant, with the cache salt
    and LoRA adapter (hashed, so any value fits) when the request has them."""
    namespace = tenant
    extra = []
    if cache_salt:
        extra.append("salt=" + hashlib.sha256(cache_salt.encode()).hexdigest()[:32])
    if lora_name:
        extra.append("lora=" + hashlib.sha256(lora_name.encode()).hexdigest()[:32])
    if extra:
        namespace += "/" + ",".join(extra)
    assert len(namespace) <= MAX_NAMESPACE_CHARS
    return check_namespace(namespace)


@dataclass(frozen=True)
class PageLoad:
    """Pages a worker reads into blocks: before the step's forward, or, when
    ``asynchronous``, on its load thread, reporting the request when done."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    asynchronous: bool = False


@dataclass(frozen=True)
class PageSave:
    """Blocks a worker stores as pages after the step's forward."""

    run: StoredRun
    block_ids: tuple[int, ...]


@dataclass
class FabricStepMeta(KVConnectorMetadata):
    """Scheduler -> workers, each step: what to load and store, and where the
    store is (once the fabric has said; ``None`` until then)."""

    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)
    store: StoreOptions | None = None


@dataclass
class FabricWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step, merged over ranks by vLLM: by rank, the
    pages it stored, the pages it could not load, and the pages whose store it
    was asked for ended (stored, failed or skipped)."""

    stored: dict[int, list[StoredRun]] = field(default_factory=dict)
    failed: dict[int, list[bytes]] = field(default_factory=dict)
    ended: dict[int, list[bytes]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> FabricWorkerMeta:
        assert isinstance(other, FabricWorkerMeta)
        stored = {**self.stored}
        for rank, runs in other.stored.items():
            stored[rank] = stored.get(rank, []) + runs
        failed = {**self.failed}
        for rank, hashes in other.failed.items():
            failed[rank] = failed.get(rank, []) + hashes
        ended = {**self.ended}
        for rank, hashes in other.ended.items():
            ended[rank] = ended.get(rank, []) + hashes
        return FabricWorkerMeta(stored, failed, ended)


# The figures a worker counts between two of vLLM's stats intervals.
STAT_KEYS = (
    "loaded_pages",
    "load_failed_pages",
    "stored_pages",
    "store_failed_pages",
    "load_seconds",
    "store_seconds",
    "l2_loaded_pages",
    "l2_stored_pages",
)


@dataclass
class FabricConnectorStats(KVConnectorStats):
    """The workers' figures for vLLM's connector stats (summed over ranks)."""

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> FabricConnectorStats:
        for key in STAT_KEYS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
