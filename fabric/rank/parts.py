"""A hybrid model's other components on one rank: its L1 sliding-window pages and
mamba states — how a compute stores them, how they are checked and read back.

A model filler (``fabric.rank.hybrid.HybridKV``) computes them; otherwise they
are synthetic (``fabric.rank.producer``), a function of the page-hash chain, so
``verify`` can recompute what a page or slot must hold.
"""

from __future__ import annotations

from typing import cast

import torch

from fabric.cache.keys import chain_hashes, namespace_seed
from fabric.config import FabricConfig
from fabric.messages import Compute
from fabric.rank.model import within
from fabric.rank.pools import KVPool, RankPools, StatePool
from fabric.rank.producer import KVFiller, SyntheticKV, SyntheticStates
from fabric.topology import Shard, kind_layers


class Parts:
    def __init__(
        self,
        shard: Shard,
        config: FabricConfig,
        pools: RankPools,
        device: torch.device,
        filler: KVFiller | None = None,
    ) -> None:
        model, page_size = config.model, config.cache.page_size
        state_elems = model.mamba_elems(config.topology.tp)
        self.shard, self.page_size, self.device = shard, page_size, device
        self.filler = filler  # a model filler's components are checked against its own
        self.sliding = cast("KVPool | None", pools.device("sliding"))
        self.states = cast("StatePool | None", pools.device("mamba"))
        self.sliding_kv = self.state_values = None
        if self.sliding is not None:
            ids = kind_layers(shard, model, "sliding")
            self.sliding_kv = SyntheticKV(shard, model, page_size, ids)
        if self.states is not None:
            ids = kind_layers(shard, model, "mamba")
            self.state_values = SyntheticStates(shard, ids, state_elems)

    def store(self, filler: KVFiller, cmd: Compute) -> None:
        """Store a compute's sliding pages and mamba states: ``filler``'s own where it
        computes them, else the synthetic ones."""
        store = getattr(filler, "store_parts", None)
        if store is not None:
            store(self.sliding, self.states, cmd)
            return
        ps = self.page_size
        for part in cmd.sliding:
            assert self.sliding is not None and self.sliding_kv is not None, (
                "sliding parts for a model without sliding layers"
            )
            start = part.page * ps
            positions, values = self.sliding_kv.expected(
                part.prev_hash, part.tokens, start, self.sliding.buffer.dtype
            )
            page_idx, offsets = self.sliding_kv.locate(positions, start, [part.pool_page])
            self.sliding.write_tokens(page_idx.to(self.device), offsets.to(self.device), values)
        for part in cmd.mamba:
            assert self.states is not None and self.state_values is not None, (
                "mamba parts for a model without mamba layers"
            )
            self.states.buffer[part.slot] = self.state_values.state(part.chain_hash)

    def verify(
        self,
        namespace: str,
        tokens: bytes,
        sliding: list[tuple[int, int]],
        mamba: list[tuple[int, int]],
    ) -> bool:
        """Whether the sliding pages ``(key page, pool page)`` and mamba slots ``(end
        page, slot)`` hold the components of the packed prefix ``tokens``: the
        synthetic ones exactly, a model filler's (``expected_parts``) as a fresh
        computation gives them, within its ``tolerance`` and ``rtol``."""
        expected = getattr(self.filler, "expected_parts", None)
        if expected is not None:
            _, *got = self.read(sliding, mamba)
            atol, rtol = self.filler.tolerance, self.filler.rtol  # type: ignore[union-attr]
            for have, want in zip(got, expected(tokens, sliding, mamba), strict=True):
                if (have is None) != (want is None):
                    return False
                if want is not None and not within(have, want, atol, rtol):
                    return False
            return True
        ps = self.page_size
        pb = ps * 4
        last = max([k + 1 for k, _ in sliding] + [e for e, _ in mamba] + [0])
        seed = namespace_seed(namespace)
        chain = [seed, *chain_hashes(seed, tokens[: last * pb], pb)]
        for k, pool_page in sliding:
            assert self.sliding is not None and self.sliding_kv is not None
            positions, want = self.sliding_kv.expected(
                chain[k], tokens[k * pb : (k + 1) * pb], k * ps, self.sliding.buffer.dtype
            )
            page_idx, offsets = self.sliding_kv.locate(positions, k * ps, [pool_page])
            got = self.sliding.read_tokens(page_idx.to(self.device), offsets.to(self.device))
            if not torch.equal(got.cpu(), want):
                return False
        for end, slot in mamba:
            assert self.states is not None and self.state_values is not None
            if not torch.equal(self.states.buffer[slot].cpu(), self.state_values.state(chain[end])):
                return False
        return True

    def read(
        self, sliding: list[tuple[int, int]], mamba: list[tuple[int, int]]
    ) -> tuple[Shard, torch.Tensor | None, torch.Tensor | None]:
        """This rank's shard of a prefix's components: the sliding layers' KV of the
        ``(key page, pool page)`` pages, ``(2, T, layers, heads, head_dim)`` over its
        positions of those pages in order, and the mamba states of the ``(end
        page, slot)`` slots, ``(n, layers, elems)``; on CPU."""
        ps = self.page_size
        kv = states = None
        if sliding and self.sliding is not None and self.sliding_kv is not None:
            positions = torch.cat(
                [self.sliding_kv.positions(k * ps, (k + 1) * ps) for k, _ in sliding]
            )
            keys = [k for k, _ in sliding]
            pool_pages = [p for _, p in sliding]
            page_idx = torch.tensor(pool_pages)[
                torch.searchsorted(torch.tensor(keys), positions // ps)
            ]
            offsets = positions % ps - self.shard.cp_rank * self.shard.page_tokens
            kv = self.sliding.read_tokens(page_idx.to(self.device), offsets.to(self.device))
            kv = kv.cpu().clone()
        if mamba and self.states is not None:
            states = self.states.buffer[[slot for _, slot in mamba]].cpu().clone()
        return self.shard, kv, states
