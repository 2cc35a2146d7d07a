"""Hugging Face ``generate()`` from the KV a kvfabric store holds.

    from fabric.client import connect
    from fabric.engines.hf import FabricGenerator
    from fabric.engines.store import StoreOptions

    fabric = connect("kvfabric")
    gen = FabricGenerator(model, fabric.config, StoreOptions(fabric="kvfabric"))
    for out in gen.generate([prompt_a, prompt_b], max_new_tokens=32):
        out.tokens, out.hit_tokens, out.stored_pages

For each prompt: the longest prefix whose pages the store holds on every shard
of the fabric's topology is read back (checked as every L3 read is), put
together into a ``DynamicCache``, and ``generate()`` computes only the rest;
then the KV of the prompt and the answer goes back to the store, page by page
and shard by shard, as the fabric's own ranks would have stored it — same keys,
same provenance, same page format. So the next turn (prompt, answer, new
message) hits through the answer, and a fabric with the same config serves
these pages to its own clients, and the other way round.

``generate()`` runs the model over the tokens after its cache: a cache that
covers the whole prompt would leave it nothing to run, so at least the last
prompt token is always left out of the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fabric.cache.keys import DEFAULT_NAMESPACE, TokenKey
from fabric.config import FabricConfig
from fabric.engines.keys import PageNamer
from fabric.engines.store import PageStore, StoreOptions, open_store
from fabric.errors import ConfigError, InvalidInput
from fabric.l3.service import component_provenances
from fabric.rank.model import assemble, hf_head_dim, to_cache
from fabric.rank.producer import ShardPositions
from fabric.topology import Shard, Topology

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Generation:
    """One prompt's answer: the new ``tokens``, the prompt tokens whose KV came from
    the store (``hit_tokens``), and the pages given back to it (``stored_pages``)."""

    tokens: list[int]
    hit_tokens: int
    stored_pages: int


@dataclass(frozen=True)
class _ShardPages:
    shard: Shard
    namer: PageNamer
    positions: ShardPositions
    row_bytes: int


class FabricGenerator:
    """``generate()`` for ``model`` over the pages of a fabric configured by ``config``
    (its model, page size, layout, dtype and topology), in ``store``."""

    def __init__(self, model: Any, config: FabricConfig, store: PageStore | StoreOptions) -> None:
        m = config.model
        if m.components != ("full",):
            raise ConfigError("FabricGenerator serves full-attention models (model.layer_kinds)")
        cfg = model.config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, hf_head_dim(cfg))
        if shape != (m.layers, m.kv_heads, m.head_dim):
            raise ConfigError(
                f"the model has layers, kv_heads, head_dim = {shape}; the fabric's config says "
                f"{(m.layers, m.kv_heads, m.head_dim)}"
            )
        self.dtype = _DTYPES[m.dtype]
        weights = next((p.dtype for p in model.parameters()), self.dtype)
        if weights != self.dtype:  # its KV would be rounded into the fabric's dtype
            raise ConfigError(
                f"the model computes in {str(weights).removeprefix('torch.')}; the fabric's "
                f"config says model.dtype={m.dtype}"
            )
        self.model = model
        self.config = config
        self.page_size = config.cache.page_size
        self.store = store if isinstance(store, PageStore) else open_store(store, "hf")
        topo = Topology(config.topology)
        provenances = component_provenances(config)
        self.shards = []
        for i in range(topo.world_size):
            shard = topo.shard(i, m, self.page_size)
            prov = provenances["full", shard.rank.suffix]
            row_bytes = (
                int(np.prod(prov.shard_shape)) * torch.empty(0, dtype=self.dtype).element_size()
            )
            self.shards.append(
                _ShardPages(
                    shard,
                    PageNamer(prov, shard.rank.suffix),
                    ShardPositions(shard, self.page_size),
                    row_bytes,
                )
            )

    def cached_pages(self, key: TokenKey) -> int:
        """How many of ``key``'s leading pages the store holds on every shard."""
        hashes = key.page_hashes()
        hit = len(hashes)
        for s in self.shards:
            if hit == 0:
                break
            hit = min(hit, self.store.exists(s.namer.keys(hashes[:hit])))
        return hit

    def load(self, key: TokenKey, pages: int) -> tuple[torch.Tensor, int]:
        """The KV ``(2, layers, kv_heads, tokens, head_dim)`` of ``key``'s first
        ``pages`` pages that every shard reads back (maybe fewer: a page that
        fails a check ends it), and how many pages that is."""
        hashes = key.page_hashes()[:pages]
        values: list[tuple[Shard, np.ndarray]] = []
        for s in self.shards:
            rows = np.empty((len(hashes), s.row_bytes), dtype=np.uint8)
            pages = min(pages, self.store.load(s.namer.keys(hashes), rows, s.namer.provenance))
            values.append((s.shard, rows))
        if pages == 0:
            return torch.empty(0), 0
        shards = []
        for shard, rows in values:
            t = torch.from_numpy(rows[:pages]).view(self.dtype)
            t = t.view(pages, 2, shard.page_tokens, shard.layers, shard.heads, -1)
            shards.append(
                (
                    shard,
                    t.permute(1, 0, 2, 3, 4, 5).reshape(
                        2, pages * shard.page_tokens, shard.layers, shard.heads, -1
                    ),
                )
            )
        return assemble(shards, self.config.model, self.page_size, pages * self.page_size), pages

    def put(self, key: TokenKey, kv: torch.Tensor, skip_pages: int) -> int:
        """Give the store ``key``'s pages after the first ``skip_pages`` whose KV ``kv``
        ``(2, layers, kv_heads, >= tokens, head_dim)`` covers, on every shard; the
        pages stored on every shard (those it held already count)."""
        m = self.config.model
        want = (2, m.layers, m.kv_heads, m.head_dim)
        if kv.dim() != 5 or (*kv.shape[:3], kv.shape[4]) != want:
            raise InvalidInput(
                f"KV of shape {tuple(kv.shape)} is refused: allowed is (2, layers, kv_heads, "
                f"tokens, head_dim) with (2, layers, kv_heads, head_dim) = {want}"
            )
        pages = min(key.num_pages, kv.shape[3] // self.page_size)
        if pages <= skip_pages:
            return 0
        hashes = key.page_hashes()[skip_pages:pages]
        n = len(hashes)
        stored = n
        for s in self.shards:
            sh = s.shard
            pos = s.positions.positions(skip_pages * self.page_size, pages * self.page_size)
            mine = kv[
                :,
                sh.layer_start : sh.layer_start + sh.layers,
                sh.head_start : sh.head_start + sh.heads,
            ]
            rows = (
                mine[:, :, :, pos]  # (2, L, H, P, D)
                .permute(0, 3, 1, 2, 4)
                .reshape(2, n, sh.page_tokens, sh.layers, sh.heads, -1)
                .permute(1, 0, 2, 3, 4, 5)
                .to(self.dtype)
                .contiguous()
                .view(torch.uint8)
                .reshape(n, s.row_bytes)
                .numpy()
            )
            keys = s.namer.keys(hashes)
            present = self.store.present(keys)
            todo = [i for i, p in enumerate(present) if not p]
            ok = [True] * n
            if todo:
                for i, good in zip(
                    todo,
                    self.store.store([keys[i] for i in todo], rows[todo], s.namer.provenance),
                    strict=True,
                ):
                    ok[i] = good
            stored = min(stored, ok.index(False) if False in ok else n)
        return stored

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        namespace: str = DEFAULT_NAMESPACE,
        **generate_kwargs: Any,
    ) -> list[Generation]:
        """Greedy (unless ``generate_kwargs`` say otherwise) answers to ``prompts``,
        each continued from the KV of its longest cached prefix, each prompt's and
        answer's KV given back to the store."""
        out = []
        for prompt in prompts:
            ids = list(prompt)
            if not ids:
                raise InvalidInput("an empty prompt is refused: give at least one token")
            key = TokenKey(ids, self.page_size, namespace)
            kv, pages = self.load(key, self.cached_pages(key))
            hit = min(pages * self.page_size, len(ids) - 1)
            cache = to_cache(kv[:, :, :, :hit], self.model) if hit > 0 else None
            x = torch.tensor([ids])
            # One prompt, no padding: every token is attended (without a mask,
            # generate would mask each token equal to the model's pad id).
            kwargs = {"attention_mask": torch.ones_like(x), **generate_kwargs}
            result = self.model.generate(
                x,
                cache=cache,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                **kwargs,
            )
            answer = result.sequences[0, len(ids) :].tolist()
            whole = TokenKey(ids + answer, self.page_size, namespace)
            layers = result.cache.layers
            full = torch.stack(
                (
                    torch.stack([layer.keys[0] for layer in layers]),
                    torch.stack([layer.values[0] for layer in layers]),
                )
            )
            stored = self.put(whole, full.float(), pages)
            out.append(Generation(answer, hit, stored))
        return out

    def close(self) -> None:
        self.store.close()
