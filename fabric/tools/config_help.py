"""What each config key does, one line a key: the words of the generated
configuration reference (``docs/configuration.md``, ``fabric.tools.reference``).
The key's type, default and allowed values come from the schema itself
(``fabric.config``), and each section's words from its class's docstring; a
test holds this table to exactly the schema's keys."""

from __future__ import annotations

KEY_HELP = {
    # cache
    "cache.page_size": "tokens per page",
    "cache.device_tokens": "L1 (device pool) size, a multiple of page_size",
    "cache.host_tokens": "L2 (host pool) size, a multiple of page_size",
    "cache.eviction_policy": "which leaf leaves a tier first; `a2q` is an adaptive 2Q that "
    "starts as LRU and learns from ghost hits (docs/running.md, Eviction policies)",
    "cache.write_policy": "when pages are copied down a tier",
    "cache.load_back_threshold": "L2 hits shorter than this many tokens are recomputed",
    "cache.pin_budget_fraction": "share of L2 that pins may hold",
    "cache.kv_events": "queue `BlockStored`/`BlockRemoved` events",
    "cache.chunk_tokens": "prefill chunk",
    "cache.host_memory": "where a Ray rank keeps L2: `shared`, a file of the node's shared "
    "memory (owner-only, checked per page) that outlives the process, so a rank restarted "
    "on its node adopts it; `process`: in the rank's process (lost with it)",
    "cache.session_tier": "where sessions keep a conversation between turns "
    "(`device`: L1, `host`: L2)",
    "cache.session_budget_fraction": "the share of the session tier sessions may hold",
    "cache.session_ttl_s": "how long an idle session lives",
    "cache.tenant_share": "share of the pin and session budgets one tenant (namespace) may "
    "hold; 1 for a single-tenant fabric",
    "cache.sliding_tokens": "a hybrid model's L1 pool of sliding-window KV",
    "cache.mamba_states": "a hybrid model's L1 pool of mamba states",
    "cache.host_sliding_tokens": "the same in L2",
    "cache.host_mamba_states": "the same in L2",
    "cache.mamba_checkpoint_tokens": "a hybrid Mamba model saves a state every this many "
    "tokens inside a filled prefix (from free state slots only)",
    # prefetch
    "prefetch.threshold_tokens": "least uncached tokens to try L3",
    "prefetch.stop_policy": "when a request stops waiting for its prefetch",
    "prefetch.timeout_base_s": "timeout = min(base + per_ki_token x tokens/1024, max)",
    "prefetch.timeout_per_ki_token_s": "see timeout_base_s",
    "prefetch.timeout_max_s": "see timeout_base_s",
    "prefetch.max_inflight_fraction": "share of L2 that prefetches in flight may hold",
    "prefetch.query_batch_pages": "pages per L3 hit query",
    # model
    "model.model_id": "names the model in L3 keys and page headers (models share one L3 safely)",
    "model.layers": "layers of the KV (split over pp)",
    "model.kv_heads": "KV heads (split over tp)",
    "model.head_dim": "size of one head",
    "model.dtype": "the KV's dtype",
    "model.layout": "how a pool lays out pages",
    "model.filler": "what computes KV: `synthetic` (checkable values), `llama` (a transformer), "
    "`hybrid` (a tiny Gemma 3, Bamba or Qwen3-Next), `constant` (no compute: measures the "
    "fabric itself); `llama` and `hybrid` need the `model` extra",
    "model.path": "a local model directory (empty: random weights)",
    "model.seed": "seed of random weights",
    "model.vocab_size": "vocabulary of random weights",
    "model.attention_heads": "query heads of random weights",
    "model.intermediate_size": "MLP width of random weights",
    "model.initializer_range": "spread of random weights",
    "model.layer_kinds": "one kind per layer (`[]`: all full)",
    "model.sliding_window": "the sliding layers' window",
    "model.mamba_state_bytes": "one mamba layer's state",
    "model.recurrent_layer": "what a `mamba` layer is for `model.filler=hybrid` "
    "(`mamba2`: Bamba; `gated_delta_net`: Qwen3-Next)",
    # topology
    "topology.tp": "tensor-parallel ranks (KV heads split over them)",
    "topology.cp": "context-parallel ranks",
    "topology.pp": "pipeline stages (layers split over them)",
    # runtime
    "runtime.name": "names the fabric's actors",
    "runtime.ray_namespace": "the Ray namespace of its actors",
    "runtime.address": "the Ray cluster to join",
    "runtime.device": "where L1 lives; `auto` uses CUDA when present",
    "runtime.namespaces": "tenant namespaces allowed (`--set runtime.namespaces=a,b`)",
    "runtime.step_interval_s": "the coordinator's pause between steps",
    "runtime.round_wait_s": "how long a rank may hold its reply to a round while it has work "
    "in flight and nothing new to report (at most half of rank_timeout_s)",
    "runtime.round_settle_s": "past a round's first news, how long more a rank holds its reply "
    "for the computes and loads still queued (at most round_wait_s; 0: reply at once)",
    "runtime.rank_timeout_s": "a rank silent this long in one round counts as absent",
    "runtime.collective_timeout_s": "how long a sharded model's rank waits in one collective "
    "before its compute fails and the epoch resets (at most half of rank_timeout_s)",
    "runtime.compiled_rounds": "consensus rounds on a Ray Compiled Graph",
    "runtime.submit_transport": "how drivers' submits reach the coordinator: zmq, a socket "
    "(its address and secret asked by Ray; Ray calls where it cannot be reached), or ray",
    "runtime.round_transport": "how rounds reach the ranks: zmq, a socket per rank "
    "(its address and secret asked of the rank by Ray), or ray, one actor call per rank",
    "runtime.rank_absent_timeout_s": "requests fail, naming the rank, once a rank is absent "
    "this long",
    "runtime.straggler_lag_s": "a rank is slow in a round when it finishes later than the "
    "first by more than the others' median lag plus this, and more than factor times it",
    "runtime.straggler_factor": "see straggler_lag_s",
    "runtime.straggler_rounds": "slow rounds in a row that name a straggler (and normal "
    "ones that clear it)",
    "runtime.straggler_policy": "`report`: name it only; `restart`: treat it as failed",
    "runtime.max_request_retries": "resets a request survives before it fails naming the reason",
    "runtime.lease_ttl_s": "a lease not released or renewed within this is released",
    "runtime.max_message_bytes": "largest coordinator/rank message; larger work is split",
    "runtime.max_pending_requests": "requests queued at the coordinator before submits are refused",
    "runtime.engine_pages": "pages of connector-attached engines the coordinator's tree holds "
    "at most; past it whole leaves are evicted from every place, in the eviction policy's order",
    "runtime.metrics_port": "the Prometheus endpoint's port, refreshed each second",
    "runtime.metrics_host": "the Prometheus endpoint's host",
    "runtime.dashboard": "start the Ray dashboard with a Ray that `launch()` starts",
    "runtime.dashboard_host": "the dashboard's host",
    "runtime.dashboard_port": "the dashboard's port",
    "runtime.log_to_driver": "actor logs printed by the driver",
    "runtime.control_resource": "the custom Ray resource of the nodes the coordinator and "
    "storage actors run on (cluster.yaml gives it to the head node)",
    # storage
    "storage.backend": "the L3 backend: `segment` (pages appended to segment files, "
    "docs/l3-format.md), `file` (a file a page shard), `redis`, `dynamic`, `none`",
    "storage.path": "the file or segment backend's directory (shared across nodes: NFS)",
    "storage.max_bytes": "L3's size cap (least recently used go first; engines' pages: the "
    "tree evicts them within it, leaves first in the eviction policy's order)",
    "storage.fsync": "fsync on every write",
    "storage.file_mode": "permissions of L3 files, whatever the umask",
    "storage.dir_mode": "permissions of L3 directories, whatever the umask",
    "storage.direct_reads": "ranks read prefetched pages of a `file` or `segment` L3 "
    "themselves (every check still made); a rank without the path reads through the "
    "storage actor",
    "storage.actors": "storage actors L3 keys are spread over (jump consistent hashing on "
    "the page hash)",
    "storage.dynamic_modules": "modules the `dynamic` backend may import",
    "storage.options": "the backend's options (`--set 'storage.options={host: 10.0.0.5}'`)",
    "storage.transfer_batch_pages": "pages per L3 batch (progress is reported per batch)",
    "storage.auth_key_file": "a secret: every L3 page carries a keyed tag (AEGIS-128X4 on "
    "pages of 64 KiB and more, AES-GCM on smaller ones; pip install 'kvfabric[auth]'), and a "
    "page without a valid one is a miss (`refused_auth`); empty: CRC and key binding only",
    # events
    "events.endpoint": "the KV event PUB socket's address (needs cache.kv_events)",
    "events.replay_endpoint": "the replay ROUTER socket's address",
    "events.topic": "the first frame of every message",
    "events.buffer_batches": "batches kept for replay",
    "events.hwm": "the PUB socket's high-water mark",
    "events.max_queue_batches": "batches queued before one is dropped",
    "events.hash_format": "how block hashes are sent",
    "events.data_parallel_rank": "the batch's rank field",
    "events.dialect": "whose names and framing: `vllm` or `sglang`",
}
