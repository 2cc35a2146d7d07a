"""What a vLLM engine's pages are: the identity each rank names once its KV cache
exists, the tag of an engine's page keys named from every rank's identity and
an epoch, the provenance a page's header carries, and a LoRA adapter's identity.

Everything that makes a block's bytes what they are is in it — the
checkpoint's content (``fabric.engines.fingerprint``: weights replaced in place
are a new identity), revision, load format, quantization, model and exact KV
cache dtypes, the model configuration as vLLM runs it (RoPE scaling and every
override), the TP/PP split, vLLM's version and device, and the rank's own
layers, KV cache spec, attention backend and tensor layout in use — so two
engines share pages exactly when every rank agrees, and a copy of a checkpoint
at another path shares.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from fabric.engines.vllm_groups import KvGroup, hybrid, kv_groups
from fabric.engines.vllm_pages import attention_group
from fabric.errors import ConfigError
from fabric.l3.format import Provenance

log = logging.getLogger(__name__)


# KV cache dtypes whose block holds every byte of its KV (scales, where there are
# any, are per layer and come from the checkpoint). Others keep per-token scales
# beside the blocks, which a page would not carry: the connector refuses them.
SERVED_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


def engine_identity(vllm_config: Any, checkpoint: str) -> dict[str, Any]:
    """Everything engine-wide that makes a block's bytes what they are, the
    checkpoint's content (``checkpoint``: its fingerprint) first: two engines
    share pages only when all of it agrees. ``ConfigError`` for a KV cache dtype
    whose pages would not hold all of their KV."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    cache_dtype = str(cache.cache_dtype)
    if cache_dtype not in SERVED_CACHE_DTYPES:
        raise ConfigError(
            f"KvFabricConnector: kv_cache_dtype={cache_dtype!r} keeps scales beside the KV "
            f"blocks, which pages would not carry; served are {list(SERVED_CACHE_DTYPES)}"
        )
    hf_config = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else {}
    for where in ("_name_or_path", "_commit_hash"):  # where it was read from, not what it is
        hf_config.pop(where, None)
    identity = {
        "vllm": vllm.__version__,
        "device": current_platform.device_type,
        "checkpoint": checkpoint,
        "revision": model.revision,
        "code_revision": getattr(model, "code_revision", None),
        "load_format": str(vllm_config.load_config.load_format),
        "quantization": str(model.quantization),
        "dtype": str(model.dtype),
        "kv_cache_dtype": cache_dtype,
        "kv_cache_dtype_skip_layers": sorted(getattr(cache, "kv_cache_dtype_skip_layers", [])),
        # The model's configuration as vLLM runs it, overrides applied: RoPE and its
        # scaling (K is cached after RoPE), quantization, sliding windows, heads.
        "hf_config": hf_config,
        "hf_overrides": getattr(model, "hf_overrides", None),
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
        "draft": draft_identity(vllm_config),
    }
    if _scaled_rope(hf_config.get("rope_scaling")) or _scaled_rope(
        hf_config.get("rope_parameters")
    ):
        identity["max_model_len"] = model.max_model_len  # some scalings depend on it
    return identity


def _scaled_rope(params: Any) -> bool:
    """Whether RoPE parameters (per layer type, perhaps) scale the positions."""
    if not isinstance(params, dict):
        return False
    if all(isinstance(v, dict) for v in params.values()) and params:
        return any(_scaled_rope(v) for v in params.values())
    return params.get("rope_type", params.get("type", "default")) not in ("default", None)


def checkpoint_of(vllm_config: Any) -> str:
    """The fingerprint of the weights this engine loaded (``fabric.engines.fingerprint``):
    the model directory or file, or a Hugging Face repo's local snapshot. A model
    whose files cannot be found gets a fingerprint of its own (logged): its pages
    are never shared with another process."""
    from fabric.engines.fingerprint import fingerprint

    model = vllm_config.model_config
    name = str(model.model)
    try:
        return fingerprint(local_checkpoint(name, model.revision, vllm_config.load_config))
    except Exception as exc:
        log.warning(
            "kvfabric connector: the checkpoint of %r cannot be fingerprinted (%s); this "
            "engine's pages are shared with no other engine process",
            name, exc,
        )  # fmt: skip
        return "unshared-" + os.urandom(16).hex()


def local_checkpoint(name: str, revision: str | None, load_config: Any = None) -> str:
    """Where a checkpoint's files are: ``name`` itself, or a Hugging Face repo's local
    snapshot (``FileNotFoundError`` when it has none here)."""
    if os.path.exists(name):
        return name
    from huggingface_hub import snapshot_download

    return snapshot_download(
        name,
        revision=revision,
        cache_dir=getattr(load_config, "download_dir", None),
        local_files_only=True,
    )


def draft_identity(vllm_config: Any) -> dict | None:
    """A speculative decoding draft model's identity, where it has one (its layers
    may share the KV cache group, and their KV is the draft's weights')."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "model", None) if spec is not None else None
    if not draft:
        return None
    from fabric.engines.fingerprint import fingerprint

    try:
        checkpoint = fingerprint(local_checkpoint(str(draft), getattr(spec, "revision", None)))
    except Exception:
        checkpoint = "unshared-" + os.urandom(16).hex()  # (never shared, as for the target)
    return {"method": str(spec.method), "checkpoint": checkpoint,
            "tokens": spec.num_speculative_tokens}  # fmt: skip


def rank_identity(
    engine: dict[str, Any], kv_cache_config: Any, kv_caches: dict[str, Any], backends: dict
) -> str:
    """The digest (64 hex digits) of one rank's pages: the engine's identity and
    this rank's own — its layers (its pipeline stage's), the KV cache spec, and
    the attention backend and tensor layout actually in use (``backends``: the
    backend's name per layer)."""
    groups = kv_groups(kv_cache_config)
    if hybrid(groups):
        return _hybrid_identity(engine, kv_cache_config, kv_caches, backends, groups)
    group = attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    identity = {
        "engine": engine,
        "spec": {
            "type": type(spec).__name__,
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "head_size_v": spec.head_size_v or spec.head_size,
            "dtype": str(spec.dtype),
            "kv_quant": str(getattr(spec, "kv_quant_mode", "")),
        },
        "cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
        "layers": _layers(group.layer_names, kv_cache_config, kv_caches, backends),
    }
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(b"kvfabric/vllm-rank\0" + blob).hexdigest()


def _hybrid_identity(
    engine: dict[str, Any], kv_cache_config: Any, kv_caches: dict[str, Any], backends: dict,
    groups: list[KvGroup],
) -> str:  # fmt: skip
    """A hybrid engine's rank: every KV cache group's kind, spec and layers."""
    identity = {
        "engine": engine,
        "groups": [
            [g.kind, g.spec, _layers(g.layer_names, kv_cache_config, kv_caches, backends)]
            for g in groups
        ],
        "cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
    }
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(b"kvfabric/vllm-hybrid-rank\0" + blob).hexdigest()


def _layers(names: Any, kv_cache_config: Any, kv_caches: dict[str, Any], backends: dict) -> list:
    blocks = max(getattr(kv_cache_config, "num_blocks", 1), 1)
    layers = []
    for name in names:
        kv = kv_caches.get(name)
        shape = list(getattr(kv, "shape", ()))
        if shape:  # how many blocks the pool holds is no part of a block's bytes
            shape[0] = shape[0] / blocks
        layers.append(
            [name, backends.get(name), shape,
             list(kv.stride()) if hasattr(kv, "stride") else None, str(getattr(kv, "dtype", ""))]
        )  # fmt: skip
    return layers


class EngineTag:
    """An engine's page tag: named from every rank's identity (``handshake``; until
    every rank has said, there is none and nothing is served) and an epoch that
    ``renew`` makes anew (a weight update: no page of before is served after)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.tag: str | None = None
        self._ranks: list[str] = []
        self._epoch = ""

    def handshake(self, identities: dict[int, str]) -> None:
        digests = [identities.get(r, "") for r in range(self.world)]
        if not all(digests):
            log.error(
                "kvfabric connector: ranks %s cannot serve their KV cache (or did not say); "
                "this engine computes every prompt",
                [r for r, d in enumerate(digests) if not d],
            )
            self.tag = None
            return
        self._ranks = digests
        self.tag = engine_tag(digests, self._epoch)
        log.info("kvfabric connector: this engine's pages are tagged %s", self.tag)

    def renew(self) -> None:
        self._epoch = os.urandom(16).hex()
        if self._ranks:
            self.tag = engine_tag(self._ranks, self._epoch)
            log.info("kvfabric connector: cache reset; this engine's pages are now %s", self.tag)


def engine_tag(rank_digests: list[str], epoch: str) -> str:
    """The tag of an engine's page keys: every rank's identity (in rank order) and
    the engine's epoch (``""`` for the weights on disk; a new random one at each
    ``reset_cache``, so pages stored before it are never served after it)."""
    blob = json.dumps([rank_digests, epoch]).encode()
    return hashlib.sha256(b"kvfabric/vllm-engine\0" + blob).hexdigest()[:16]


def page_provenance(
    kv_cache_config: Any, rank_digest: str, group: KvGroup | None = None
) -> Provenance:
    """The provenance a rank's pages carry in their headers (checked on every
    read): its own identity, and its shard's shape — of ``group``'s pages, on a
    hybrid engine (each group's layout its own)."""
    if group is not None and hybrid(kv_groups(kv_cache_config)):
        spec = kv_cache_config.kv_cache_groups[group.index].kv_cache_spec
        dtypes = getattr(spec, "dtypes", None) or (spec.dtype,)
        return Provenance(
            model_id="vllm",
            layout=f"vllm-block/{rank_digest[:32]}/{group.kind}{group.index}",
            dtype="+".join(str(d).removeprefix("torch.") for d in dtypes),
            shard_shape=(len(group.layer_names), group.block_bytes),
            page_size=group.block_size,
        )
    group = attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    return Provenance(
        model_id="vllm",
        layout=f"vllm-block/{rank_digest[:32]}",
        dtype=str(spec.dtype).removeprefix("torch."),
        shard_shape=(len(group.layer_names), spec.num_kv_heads, spec.block_size, spec.head_size),
        page_size=spec.block_size,
    )


def lora_identity(lora_request: Any) -> str | None:
    """What names a LoRA adapter's effect on KV: its weights' fingerprint (its
    directory's, or a Hugging Face repo's local snapshot), so two adapters of one
    name but other weights, or one adapter replaced in place, never share pages.
    ``None`` (logged) for an adapter whose files cannot be read: its requests are
    neither loaded nor stored."""
    from fabric.engines.fingerprint import fingerprint

    path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", None)
    try:
        if not path:
            raise FileNotFoundError("the LoRA request names no path")
        return "lora:" + fingerprint(local_checkpoint(str(path), None))
    except Exception as exc:
        log.warning(
            "kvfabric connector: LoRA adapter %r cannot be fingerprinted (%s); its requests "
            "are served without the fabric",
            getattr(lora_request, "lora_name", "?"), exc,
        )  # fmt: skip
        return None
