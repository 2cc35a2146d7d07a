"""A vLLM engine's KV cache groups as the fabric's components (hybrid models,
vLLM's hybrid KV cache manager: ``SupportsHMA``).

vLLM splits a hybrid model's layers into KV cache groups, each with a block
table of its own over one pool of blocks. Each group is a component of the
fabric's pages, as the Unified cache's components are:

- ``full`` (full attention): every page, as for a model of one group; the
  first full group's pages are the engine's chain (its tag, its lookups);
- ``window`` (sliding-window attention): a hit needs only the window before
  the hit point — ``ceil((window - 1) / block)`` pages, the blocks vLLM keeps
  for it; the pages before are tombstones, never stored nor loaded;
- ``state`` (gated delta net, Mamba, in vLLM's ``align`` cache mode): the
  recurrent state at a block boundary, saved where vLLM hands it off (exact
  block ids: ``SchedulerOutput.kv_connector_block_state``), and a hit needs
  the state at its last page.

A hit is the deepest page end where every component can serve, the MIN over
the engine's ranks (``EngineTree.lookup``'s ``needs``). Each group's pages are
its own keys, under a tag named from the engine's and the group's index.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from fabric.errors import ConfigError

FULL, WINDOW, STATE = "full", "window", "state"
SUPPORTED = (
    "full attention (FullAttentionSpec, separate K and V), sliding-window attention "
    "(SlidingWindowSpec), and gated delta net or Mamba state in vLLM's 'align' cache mode "
    "(MambaSpec)"
)


@dataclass(frozen=True)
class KvGroup:
    """One of vLLM's KV cache groups, as the connector serves it."""

    index: int  # in ``kv_cache_config.kv_cache_groups``
    kind: str  # FULL, WINDOW or STATE
    layer_names: tuple[str, ...]
    block_size: int
    block_bytes: int  # one block of one layer on one rank: the bytes a page holds per layer
    before: int  # pages before a hit point a hit needs of it (0: every page)
    spec: str  # the spec as vLLM states it (part of the pages' identity)

    @property
    def primary(self) -> bool:
        return self.kind == FULL


def _kind(spec: Any) -> str:
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":
        raise ConfigError(
            f"KvFabricConnector serves {SUPPORTED}; a KV cache group of layers of several "
            f"shapes ({name}) is not among them"
        )
    if getattr(spec, "use_mla", False) or "MLA" in name:
        raise ConfigError(
            f"KvFabricConnector serves {SUPPORTED}; this model's KV cache is latent (MLA, {name})"
        )
    if name == "MambaSpec" or hasattr(spec, "mamba_cache_mode"):
        mode = getattr(spec, "mamba_cache_mode", None)
        if mode != "align":
            raise ConfigError(
                f"KvFabricConnector serves {SUPPORTED}; this model's state group ({name}) "
                f"caches in mode {mode!r}: run vLLM with prefix caching on and "
                f"mamba_cache_mode='align'"
            )
        return STATE
    if getattr(spec, "attention_chunk_size", None) or "Chunked" in name or "Cross" in name:
        raise ConfigError(f"KvFabricConnector serves {SUPPORTED}; a {name} group is not among them")
    if getattr(spec, "sliding_window", None):
        return WINDOW
    if hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"):
        return FULL
    raise ConfigError(f"KvFabricConnector serves {SUPPORTED}; a {name} group is not among them")


def _block_bytes(spec: Any, kind: str) -> int:
    if kind == STATE:  # the state's content, not the padding vLLM gives its blocks
        shapes, dtypes = spec.shapes, spec.dtypes
        return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    head_v = spec.head_size_v or spec.head_size
    return spec.num_kv_heads * spec.block_size * (spec.head_size + head_v) * spec.dtype.itemsize


def kv_groups(kv_cache_config: Any) -> list[KvGroup]:
    """The engine's KV cache groups as components; ``ConfigError`` naming the group
    and what the connector serves when one is of a kind it cannot serve, when
    none is full attention, or when their block sizes differ."""
    specs = kv_cache_config.kv_cache_groups
    if not specs:
        raise ConfigError("KvFabricConnector: this engine has no KV cache group")
    out = []
    for i, group in enumerate(specs):
        spec = group.kv_cache_spec
        kind = _kind(spec)
        before = 0
        if kind == WINDOW:
            before = max(-(-(spec.sliding_window - 1) // spec.block_size), 1)
        elif kind == STATE:
            before = 1
        out.append(
            KvGroup(i, kind, tuple(group.layer_names), spec.block_size,
                    _block_bytes(spec, kind), before, repr(spec))
        )  # fmt: skip
    kinds = [
        f"{g.index}: {type(s.kv_cache_spec).__name__}" for g, s in zip(out, specs, strict=True)
    ]
    if not any(g.kind == FULL for g in out):
        raise ConfigError(
            f"KvFabricConnector needs a full-attention KV cache group (its pages name a "
            f"prefix); this model's groups are {kinds}"
        )
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise ConfigError(
            f"KvFabricConnector serves KV cache groups of one block size; this model's "
            f"groups {kinds} have block sizes {sorted(sizes)}"
        )
    return out


def primary_of(groups: list[KvGroup]) -> KvGroup:
    """The group whose pages are the engine's chain: the first full-attention one."""
    return next(g for g in groups if g.kind == FULL)


def hybrid(groups: list[KvGroup]) -> bool:
    return len(groups) > 1


def group_tag(tag: str, group: KvGroup, primary: KvGroup) -> str:
    """The tag of ``group``'s pages on an engine tagged ``tag``: the engine's own for
    its primary group, else one named from it and the group's index."""
    return tag if group.index == primary.index else component_tag(tag, group.index)


def component_tag(tag: str, index: int) -> str:
    """The tag of KV cache group ``index``'s pages on an engine tagged ``tag``."""
    blob = f"kvfabric/vllm-group\0{tag}\0{index}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def needs_of(tag: str, groups: list[KvGroup]) -> list[tuple[str, int]]:
    """What a lookup of an engine tagged ``tag`` needs of its other groups."""
    primary = primary_of(groups)
    return [(group_tag(tag, g, primary), g.before) for g in groups if g.index != primary.index]
