"""What a vLLM engine attached through ``KvFabricConnector`` and the fabric agree
on: the connector's options, the identity and keys of its pages, and the
messages between its scheduler side and its workers.

One fabric page is one vLLM block of one rank: every layer's KV of the block's
tokens, for the KV heads that rank holds (TP) in the layers of its stage (PP).
Pages are named by kvfabric's own chain hash over the block's tokens, seeded by
the namespace (``fabric.cache.keys``): the tenant the connector serves, with the
request's cache salt and LoRA adapter (its weights' fingerprint) folded in, so
requests that must not share KV never share a key.

A page's key also carries the engine's tag: a digest of everything that makes a
block's bytes what they are (``vllm_identity``), named from every rank's
identity and an epoch that ``reset_cache`` renews, and sent with every load and
store. Two engines share pages exactly when every rank agrees; a page's header
carries its rank's identity too, checked on every read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from fabric.cache.engine_input import StoredRun, part
from fabric.cache.engine_places import Order
from fabric.cache.keys import MAX_NAMESPACE_CHARS, check_namespace
from fabric.engines.store import StoreOptions
from fabric.errors import ConfigError


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
    if getattr(spec, "sliding_window", None):
        raise ConfigError(
            f"KvFabricConnector serves full attention; this model's KV cache keeps a "
            f"sliding window of {spec.sliding_window} tokens ({type(spec).__name__})"
        )
    if getattr(spec, "use_mla", False):
        raise ConfigError(
            f"KvFabricConnector serves attention with separate K and V; this model's KV "
            f"cache is latent (MLA, {type(spec).__name__})"
        )
    return groups[0]


def block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block of one layer on one rank, as the KV cache spec sizes it."""
    spec = attention_group(kv_cache_config).kv_cache_spec
    head_v = spec.head_size_v or spec.head_size
    itemsize = spec.dtype.itemsize
    return spec.num_kv_heads * spec.block_size * (spec.head_size + head_v) * itemsize


def request_namespace(tenant: str, cache_salt: str | None, lora: str | None) -> str:
    """The kvfabric namespace of a request's pages: the tenant, with the cache salt
    and LoRA adapter (``lora``: its identity, ``vllm_identity.lora_identity``) hashed in when the
    request has them, so any value fits."""
    namespace = tenant
    extra = []
    if cache_salt:
        extra.append("salt=" + hashlib.sha256(cache_salt.encode()).hexdigest()[:32])
    if lora:
        extra.append("lora=" + hashlib.sha256(lora.encode()).hexdigest()[:32])
    if extra:
        namespace += "/" + ",".join(extra)
    assert len(namespace) <= MAX_NAMESPACE_CHARS
    return check_namespace(namespace)


@dataclass(frozen=True)
class PageLoad:
    """Pages a worker reads into blocks, under the engine's page tag ``tag``:
    before the step's forward or, when ``asynchronous``, on its load thread,
    reporting the request when done. Every rank reports how many it loaded under
    ``load_id`` (``FabricWorkerMeta.loaded``). The pages follow ``parent`` in
    ``namespace``'s chain (what a page read from L3 is reported as once the node's
    L2 keeps it too). With ``limit_s`` (the ``timeout`` prefetch stop policy), no
    L3 read starts later than that after the load did: the pages after are
    computed, with no verdict on them."""

    load_id: int
    req_id: str
    tag: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    asynchronous: bool = False
    namespace: str = ""
    parent: bytes | None = None
    limit_s: float = 0.0
    group: int = 0  # the KV cache group whose blocks these are (``vllm_groups``)

    def run(self, start: int = 0, end: int | None = None) -> StoredRun:
        """Pages ``[start, end)`` as a run (after their parent)."""
        whole = StoredRun(self.namespace, self.parent, self.hashes)
        return part(whole, start, len(self.hashes) if end is None else end)


@dataclass(frozen=True)
class PageSave:
    """Blocks a worker stores as pages under the tag ``tag`` once the step's
    forward is done (blocks computed this step or earlier)."""

    tag: str
    run: StoredRun
    block_ids: tuple[int, ...]
    group: int = 0  # the KV cache group whose blocks these are (``vllm_groups``)


@dataclass
class FabricStepMeta(KVConnectorMetadata):
    """Scheduler -> workers, each step: what to load and store, where the store is
    (once the fabric has said; ``None`` until then), and the finished requests
    whose blocks vLLM keeps for this step's stores (``finished``: each worker
    reports them sent once it has gathered them), and what the fabric's tree asks
    of this engine's ranks (``orders``: deletes, and copies to L3)."""

    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)
    store: StoreOptions | None = None
    finished: list[str] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)  # requests whose async loads to give up
    orders: list[Order] = field(default_factory=list)  # the fabric tree's, to carry out
    groups: dict[str, int] = field(default_factory=dict)  # a hybrid engine's: tag -> group


@dataclass
class FabricWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step, merged over ranks by vLLM:

    - ``stored``: ``(tag, rank, run)`` for the pages a rank stored;
    - ``failed``: ``(tag, rank, page hash)`` for the first page of a load a rank
      could not load (missing, or refused by a check);
    - ``ended``: ``(rank, page hash)`` for each page whose store a rank was asked
      for and ended (stored, failed, dropped or skipped);
    - ``loaded``: ``(rank, load_id, pages)`` for each load a rank ended, with how
      many leading pages it loaded (the rest are load errors);
    - ``orders_done``: the steps' batches of the fabric's orders the ranks have
      carried out (each rank counts each batch it was handed once)."""

    stored: list[tuple[str, int, StoredRun]] = field(default_factory=list)
    failed: list[tuple[str, int, bytes]] = field(default_factory=list)
    ended: list[tuple[int, bytes]] = field(default_factory=list)
    loaded: list[tuple[int, int, int]] = field(default_factory=list)
    orders_done: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> FabricWorkerMeta:
        assert isinstance(other, FabricWorkerMeta)
        return FabricWorkerMeta(
            self.stored + other.stored,
            self.failed + other.failed,
            self.ended + other.ended,
            self.loaded + other.loaded,
            self.orders_done + other.orders_done,
        )


@dataclass
class FabricHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start (vLLM's handshake): the rank and the
    digest of its pages' identity (``vllm_identity.rank_identity``; ``""``: the worker cannot
    serve its KV cache, and the engine runs without the fabric)."""

    rank: int
    identity: str


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
    "store_dropped_pages",
    "l2_promotions_dropped",
    "load_timeouts",
    "l3_deleted_pages",
    "l2_dropped_pages",
    "l3_copied_pages",
    "l2_prefetched_pages",
    "orders_failed",
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
