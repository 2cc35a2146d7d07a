"""kvfabric as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``): a vLLM
engine as a full client of a running fabric.

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KvFabricConnector",
        "kv_connector_module_path": "fabric.engines.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"fabric": "kvfabric", "namespace": "vllm"}})

The scheduler side (``fabric.engines.vllm_scheduler``) asks the fabric's
coordinator, once per engine step, how much of each new prompt every rank of
the engine has stored — the coordinator's MIN over the engine's TP ranks and PP
stages — and tells the coordinator, from the workers' reports, which pages
every rank has now stored. The worker side (``fabric.engines.vllm_worker``)
plays the rank role in each vLLM worker: vLLM's blocks are its L1 pool, pages
move between them and the fabric's L3 directory, each rank its own shard under
its own key. Several engines (processes, nodes, Ray Serve replicas) attached to
one fabric share every prefix any of them computed.

A page is served only to an engine whose every rank would have computed the
same bytes: each worker names its pages' identity once its KV cache exists
(``vllm_identity.rank_identity``: the checkpoint's content fingerprint, the model
configuration as run, dtypes, the layout in use...) and hands it to the
scheduler side through vLLM's connector handshake; the engine's tag, in every
page key, is named from all of them and an epoch that ``reset_cache`` renews.

Nothing the fabric does can stop the engine: an unreachable or dead fabric is
logged once and every prompt is computed until it is back; a page that is
missing or fails a check is recomputed by vLLM (the connector sets
``kv_load_failure_policy`` to ``recompute``), never served, and nothing computed
over it is stored; no wait on the fabric or the store outlasts ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from fabric.cache.engine_input import node_place
from fabric.engines.fabric_link import FabricLink
from fabric.engines.store import parse_options
from fabric.engines.vllm_groups import KvGroup, hybrid, kv_groups, primary_of
from fabric.engines.vllm_hybrid import HybridWorker
from fabric.engines.vllm_identity import (
    checkpoint_of,
    engine_identity,
    page_provenance,
    rank_identity,
)
from fabric.engines.vllm_l1 import DeviceBlocks, subscribe_endpoint
from fabric.engines.vllm_pages import (
    ConnectorOptions,
    FabricConnectorStats,
    FabricHandshake,
    FabricStepMeta,
    attention_group,
    block_bytes,
    placement_of,
)
from fabric.engines.vllm_scheduler import SchedulerSide
from fabric.engines.vllm_worker import L2Options, WorkerSide
from fabric.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


log = logging.getLogger(__name__)


def _backends(vllm_config: Any) -> dict[str, str]:
    """The attention backend and implementation in use, per layer (what lays a
    block out in memory)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    out = {}
    for name, layer in context.items():
        backend = getattr(layer, "attn_backend", None)
        get_name = getattr(backend, "get_name", None)
        out[name] = "/".join(
            [str(get_name() if callable(get_name) else backend),
             type(getattr(layer, "impl", None)).__name__]
        )  # fmt: skip
    return out


def _device_blocks(vllm_config: Any, block_size: int, kv_cache_config: Any) -> DeviceBlocks | None:
    """This replica's blocks as an L1 place, where vLLM publishes its KV events."""
    endpoint = subscribe_endpoint(vllm_config)
    if endpoint is None:
        log.info(
            "kvfabric connector: vLLM's KV events (kv_events_config, zmq, bound here) are "
            "off: this replica's blocks are not shown as an L1 place"
        )
        return None
    topic = vllm_config.kv_events_config.topic
    blocks = DeviceBlocks(endpoint, topic, block_size, max(4 * kv_cache_config.num_blocks, 1 << 16))
    log.info("kvfabric connector: this replica's blocks are %s (events %s)", blocks.place, endpoint)
    return blocks


def _log_to_stderr() -> None:
    """With ``KVFABRIC_LOG_LEVEL`` set (``INFO``, ``DEBUG``...), the connector's lines
    at that level go to stderr in every engine process (vLLM configures only its
    own loggers, and its processes are spawned: the environment reaches them)."""
    level = os.environ.get("KVFABRIC_LOG_LEVEL", "").upper()
    logger = logging.getLogger("fabric")
    if not level or getattr(logger, "_kvfabric_stderr", False):
        return
    if not isinstance(logging.getLevelName(level), int):
        raise ConfigError(
            f"KVFABRIC_LOG_LEVEL={level!r} is refused: allowed is DEBUG, INFO, WARNING or ERROR"
        )
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    logger._kvfabric_stderr = True  # type: ignore[attr-defined]


class KvFabricConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_to_stderr()
        transfer = vllm_config.kv_transfer_config
        self.options: ConnectorOptions = parse_options(
            ConnectorOptions, transfer.kv_connector_extra_config or {}, "kv_connector_extra_config"
        )
        placement = placement_of(vllm_config)
        # Its KV cache groups (a hybrid model's several: ``vllm_groups``); a group of a
        # kind the connector cannot serve stops the engine here, naming it.
        self.groups: list[KvGroup] = kv_groups(kv_cache_config)
        self.primary = primary_of(self.groups)
        group = kv_cache_config.kv_cache_groups[self.primary.index]
        if not hybrid(self.groups):
            group = attention_group(kv_cache_config)
        self.scheduler_side: SchedulerSide | None = None
        self.device_blocks: DeviceBlocks | None = None  # this replica's L1, from KV events
        self.worker_side: WorkerSide | HybridWorker | None = None
        self._identity = ""  # this worker's pages' identity, once its KV cache is known
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                # A page that fails a check must be recomputed, never fail the request.
                transfer.kv_load_failure_policy = "recompute"
            block_size = group.kv_cache_spec.block_size
            self.scheduler_side = self._scheduler_side(placement, block_size)
            self.device_blocks = _device_blocks(vllm_config, block_size, kv_cache_config)
        else:
            self.worker_side = self._worker_side(placement, group, kv_cache_config)

    def _scheduler_side(self, placement: Any, block_size: int) -> SchedulerSide:
        o = self.options
        link = FabricLink(o.fabric, o.address, o.ray_namespace, o.timeout_s, o.retry_s)
        link.place = node_place(o.l2_dir) if o.l2_bytes else ""  # its lookups count this L2
        # (a hybrid engine's groups split it: a region each, ``HybridWorker``)
        link.place_bytes = o.l2_bytes * placement.world // len(self.groups)
        side = SchedulerSide(o, placement.suffixes(), block_size, link, groups=self.groups)
        link.start()  # attach at start-up, so the first requests can hit
        return side

    def _worker_side(
        self, placement: Any, group: Any, kv_cache_config: Any
    ) -> WorkerSide | HybridWorker:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        from fabric.engines.store import StoreOptions

        o = self.options
        placement = type(placement)(
            placement.tp_size,
            placement.pp_size,
            get_tensor_model_parallel_rank(),
            get_pp_group().rank_in_group,
        )
        if hybrid(self.groups):
            store = StoreOptions(path=o.path) if o.path else None
            l2 = L2Options(o.l2_bytes, o.l2_dir, o.fabric, o.ray_namespace)
            num_blocks = kv_cache_config.num_blocks
            return HybridWorker(placement, self.groups, num_blocks, store, l2, o.timeout_s)
        return WorkerSide(
            placement,
            list(group.layer_names),
            kv_cache_config.num_blocks,
            block_bytes(kv_cache_config),
            StoreOptions(path=o.path) if o.path else None,
            L2Options(o.l2_bytes, o.l2_dir, o.fabric, o.ray_namespace),
            timeout_s=o.timeout_s,
        )

    # -- the engine's identity (vLLM's connector handshake) -----------------------------

    def get_handshake_metadata(self) -> FabricHandshake | None:
        if self.worker_side is None:
            return None
        return FabricHandshake(self.worker_side.placement.rank, self._identity)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        if self.scheduler_side is None:
            return
        tp = self._vllm_config.parallel_config.tensor_parallel_size
        ranks = {
            pp * tp + tp_rank: meta
            for (pp, tp_rank), meta in metadata.items()
            if isinstance(meta, FabricHandshake)
        }
        self.scheduler_side.handshake(ranks)

    def reset_cache(self) -> bool:
        """After a weight update (``reset_prefix_cache(reset_connector=True)``): pages
        this engine stored before are never served to it after (a new epoch)."""
        return self.scheduler_side.reset() if self.scheduler_side is not None else True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that never happened is a later miss

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Take the KV cache, and name this rank's pages' identity from everything
        that makes their bytes (``rank_identity``), the layout in use included."""
        assert self.worker_side is not None
        config, kv_cache_config = self._vllm_config, self._kv_cache_config
        side = self.worker_side
        try:
            engine = engine_identity(config, checkpoint_of(config))
            digest = rank_identity(engine, kv_cache_config, kv_caches, _backends(config))
        except ConfigError as exc:
            log.error("kvfabric connector: %s; this engine computes every prompt", exc)
            kv_caches, digest = {}, "0" * 64
        if isinstance(side, HybridWorker):
            side.register(
                kv_caches,
                {g.index: page_provenance(kv_cache_config, digest, g) for g in self.groups},
            )
        else:
            side.register(kv_caches, page_provenance(kv_cache_config, digest))
        self._identity = "" if side.broken or not kv_caches else digest

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self.worker_side is not None and isinstance(meta, FabricStepMeta)
        self.worker_side.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker_side is not None
        self.worker_side.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self.worker_side is not None
        self.worker_side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert self.worker_side is not None and isinstance(meta, FabricStepMeta)
        self.worker_side.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        sent = self.worker_side.finished_sends()
        return sent or None, self.worker_side.finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid engine's loads end per request: failed ones too (``failed_recving``:
        vLLM recomputes the request from its start, as it takes no block of an
        engine of several KV cache groups)."""
        side = self.worker_side
        if not isinstance(side, HybridWorker):
            return super().get_transfer_results(finished_req_ids)
        done, failed = side.finished_loads()
        if failed:
            log.warning("kvfabric connector: %d requests' loads failed; recomputed", len(failed))
        return KVConnectorTransferResults(side.finished_sends(), done, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.load_errors() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self.worker_side.worker_meta() if self.worker_side is not None else None

    def get_kv_connector_stats(self) -> FabricConnectorStats | None:
        return self.worker_side.take_stats() if self.worker_side is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> FabricConnectorStats | None:
        return FabricConnectorStats(data=dict(data)) if data is not None else FabricConnectorStats()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        side = self.scheduler_side
        if self.device_blocks is not None:
            if side is not None and side.tag is not None:  # its blocks go with it
                log.info("kvfabric connector: %s leaves the fabric", self.device_blocks.place)
                side.link.drop(side.tag, side.world, self.device_blocks.place, [], everything=True)
            self.device_blocks.close()
        if side is not None:
            side.close()  # (after the reports in flight, that drop among them)

    # -- scheduler side ---------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self.scheduler_side
        assert side is not None
        meta = side.step_meta(scheduler_output)
        l1 = self.device_blocks
        if l1 is not None and side.tag is not None:
            cached = scheduler_output.scheduled_cached_reqs.req_ids
            for rid in [*(r.req_id for r in scheduler_output.scheduled_new_reqs), *cached]:
                state = side.tracked.get(rid)
                if state is not None:
                    l1.learn(state)
            l1.poll(side.tag, side.world, side.link)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.worker_output(connector_output.kv_connector_worker_meta)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.pending_writes()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Whether vLLM keeps the request's blocks for now: while an asynchronous
        load writes them, or until its last whole pages are stored."""
        if self.scheduler_side is None:
            return False, None
        return self.scheduler_side.finished(request, block_ids), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """``request_finished`` with every KV cache group's blocks (``SupportsHMA``)."""
        if self.scheduler_side is None:
            return False, None
        primary = block_ids[self.primary.index]
        return self.scheduler_side.finished(request, primary, block_ids), None
