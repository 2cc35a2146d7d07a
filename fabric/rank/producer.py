"""Who fills new KV on a rank: a real model, the synthetic producer, or a
constant fill that computes nothing (``ConstantKV``).

The synthetic producer makes every KV value a deterministic function of the
namespace, the whole token prefix up to that position, the (global) layer,
head, head dim and K/V. Any page that comes back from any tier can then be
checked against a fresh computation: a stale, misplaced, cross-namespace or
wrong-shard page does not match.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, unpack_tokens
from fabric.config import ModelConfig
from fabric.rank.pools import KVPool
from fabric.topology import Shard

# 31-bit arithmetic: no product below exceeds 2**62, so nothing overflows int64.
_MASK = (1 << 31) - 1


class KVFiller(Protocol):
    """Fills L1 with the KV of new tokens (the prefill of the missing part), and
    recomputes it for checks: stored KV matches a recomputation within
    ``tolerance + rtol * max|expected|`` (``fabric.rank.model.within``; both 0:
    bit for bit)."""

    tolerance: float
    rtol: float

    def fill(
        self,
        pool: KVPool,
        namespace: str,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        pages: list[int],
        prefix: bytes = b"",
        prefix_pages: list[int] | None = None,
        keep: int = 0,
    ) -> None:
        """Compute KV for the packed ``tokens`` at positions ``[start_token,
        start_token + len(tokens) // 4)`` and store this rank's shard of it in
        ``pages`` (one page per ``page_size`` tokens, the last maybe partial).
        ``start_token`` is page aligned; ``prev_hash`` is the page-hash chain up
        to it (the namespace seed at 0), which stands for everything before it;
        ``prefix`` is the tokens before it, for a filler that needs them, and
        ``prefix_pages`` the pool pages that hold their KV; the first of ``pages``
        already holds the KV of its first ``keep`` tokens (a filler may skip them)."""

    def expected(
        self,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        dtype: torch.dtype,
        prefix: bytes = b"",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's positions among ``tokens`` and their KV ``(2, T, layers,
        heads, head_dim)``, as ``fill`` stores it."""

    def locate(
        self, positions: torch.Tensor, start_token: int, pages: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool page and in-page offset of each position (pages start at ``start_token``)."""


class ShardPositions:
    """Which token positions a shard holds, and where in its pages they go."""

    tolerance = rtol = 0.0  # synthetic KV: a recomputation is bit for bit the same

    def __init__(self, shard: Shard, page_size: int) -> None:
        self.shard = shard
        self.page_size = page_size
        # Tokens this filler has computed (``fill``), for the ranks' figures.
        self.computed_tokens = 0

    def positions(self, start_token: int, end_token: int) -> torch.Tensor:
        """This shard's token positions in ``[start_token, end_token)``."""
        pt, first = self.shard.page_tokens, self.shard.cp_rank * self.shard.page_tokens
        t = torch.arange(start_token, end_token, dtype=torch.int64)
        offset = t % self.page_size
        return t[(offset >= first) & (offset < first + pt)]

    def locate(
        self, positions: torch.Tensor, start_token: int, pages: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool page and in-page offset of each position (pages start at ``start_token``)."""
        pos = positions
        page_of = torch.tensor(pages, dtype=torch.int64)[(pos - start_token) // self.page_size]
        offsets = pos % self.page_size - self.shard.cp_rank * self.shard.page_tokens
        return page_of, offsets

    def expected(
        self,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        dtype: torch.dtype,
        prefix: bytes = b"",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def fill(
        self,
        pool: KVPool,
        namespace: str,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        pages: list[int],
        prefix: bytes = b"",
        prefix_pages: list[int] | None = None,
        keep: int = 0,
    ) -> None:
        positions, values = self.expected(prev_hash, tokens, start_token, pool.buffer.dtype, prefix)
        self.computed_tokens += len(tokens) // TOKEN_BYTES
        if positions.numel() == 0:
            return
        page_idx, offsets = self.locate(positions, start_token, pages)
        pool.write_tokens(page_idx, offsets, values)


class SyntheticKV(ShardPositions):
    """The deterministic producer; also recomputes expected values for checks."""

    def __init__(
        self,
        shard: Shard,
        model: ModelConfig,
        page_size: int,
        layer_ids: list[int] | None = None,
    ) -> None:
        """``layer_ids``: the global layers whose KV it makes (default: the shard's)."""
        super().__init__(shard, page_size)
        self.head_dim = model.head_dim
        if layer_ids is None:
            layer = torch.arange(shard.layer_start, shard.layer_start + shard.layers)
        else:
            layer = torch.tensor(layer_ids, dtype=torch.int64)
        head = torch.arange(shard.head_start, shard.head_start + shard.heads)
        dim = torch.arange(model.head_dim)
        kv = torch.arange(2)
        # One salt per (kv, layer, head, dim) cell, broadcast against positions.
        self.salt = (
            kv.view(2, 1, 1, 1) * 0x3C6EF372
            + layer.view(1, -1, 1, 1) * 0x1B873593
            + head.view(1, 1, -1, 1) * 0x0E6546B6
            + dim.view(1, 1, 1, -1) * 0x6A09E667
        ) & _MASK

    def prefix_codes(
        self, prev_hash: bytes, tokens: bytes, start_token: int, positions: torch.Tensor
    ) -> torch.Tensor:
        """One 31-bit int per position that depends on everything before it: the
        page-hash chain up to its page (continued from ``prev_hash``, the chain up to
        the page-aligned ``start_token`` where ``tokens`` begin), then a running mix
        within the page."""
        if positions.numel() == 0:
            return positions
        ps, page_bytes = self.page_size, self.page_size * TOKEN_BYTES
        base = start_token // ps
        first_page, last_page = int(positions[0]) // ps - base, int(positions[-1]) // ps - base
        chain = [prev_hash, *chain_hashes(prev_hash, tokens[: last_page * page_bytes], page_bytes)]
        window = unpack_tokens(tokens[first_page * page_bytes : (last_page + 1) * page_bytes])
        window += [0] * (-len(window) % ps)  # a partial last page: what follows is unused
        ids = torch.tensor(window, dtype=torch.int64).view(-1, ps) & _MASK
        mixed = ((ids + 1) * 0x5851F42D + torch.arange(ps) * 0x14057B7E) & _MASK
        running = torch.cumsum(mixed, dim=1) & _MASK
        seeds = torch.tensor(
            [int.from_bytes(h[:4], "little") & _MASK for h in chain[first_page : last_page + 1]],
            dtype=torch.int64,
        )
        codes = (running + seeds.view(-1, 1) * 0x27D4EB2F) & _MASK
        return codes.view(-1)[positions - (base + first_page) * ps]

    def values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(2, T, layers, heads, head_dim)`` values in ``[-0.5, 0.5)``."""
        x = ((codes.view(1, -1, 1, 1, 1) ^ self.salt.unsqueeze(1)) * 0x2127599B) & _MASK
        x = (x >> 7) % 8191
        return (x.to(torch.float32) / 8191 - 0.5).to(dtype)

    def expected(
        self,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        dtype: torch.dtype,
        prefix: bytes = b"",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's positions among ``tokens`` (which begin at the page-aligned
        ``start_token``, after the chain ``prev_hash``) and their expected KV."""
        end = start_token + len(tokens) // TOKEN_BYTES
        positions = self.positions(start_token, end)
        codes = self.prefix_codes(prev_hash, tokens, start_token, positions)
        return positions, self.values(codes, dtype)


class ConstantKV(ShardPositions):
    """No compute (``model.filler=constant``): each position's KV is one value,
    repeated over K/V, layers, heads and dims, from its page's chain hash (all
    that comes before the page), its token id, its offset and the shard. A fill is a strided
    write, so a run measures the fabric itself — allocation, copies, consensus,
    L3 — apart from KV production (``bench/fabric_load.py``). A page is still
    checkable: one of another prefix, namespace or position does not match."""

    def __init__(self, shard: Shard, model: ModelConfig, page_size: int) -> None:
        super().__init__(shard, page_size)
        self.shape = (2, shard.layers, shard.heads, model.head_dim)
        # Another shard's page (other layers or heads) does not match either.
        self.salt = (shard.layer_start * 0x1B873593 + shard.head_start * 0x0E6546B6) & _MASK

    def expected(
        self,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        dtype: torch.dtype,
        prefix: bytes = b"",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = start_token + len(tokens) // TOKEN_BYTES
        positions = self.positions(start_token, end)
        kv, layers, heads, dim = self.shape
        if positions.numel() == 0:
            return positions, torch.empty((kv, 0, layers, heads, dim), dtype=dtype)
        ps, page_bytes = self.page_size, self.page_size * TOKEN_BYTES
        last = (int(positions[-1]) - start_token) // ps
        chain = [prev_hash, *chain_hashes(prev_hash, tokens[: last * page_bytes], page_bytes)]
        seeds = torch.tensor(
            [int.from_bytes(h[:4], "little") & _MASK for h in chain], dtype=torch.int64
        )
        index = positions - start_token
        ids = torch.tensor(unpack_tokens(tokens), dtype=torch.int64)[index] & _MASK
        codes = (
            seeds[index // ps] * 0x27D4EB2F
            + (ids + 1) * 0x5851F42D
            + positions % ps * 0x14057B7E
            + self.salt
        ) & _MASK
        values = ((codes * 0x2127599B & _MASK) >> 7) % 8191
        one = (values.to(torch.float32) / 8191 - 0.5).to(dtype)
        return positions, one.view(1, -1, 1, 1, 1).expand(kv, -1, layers, heads, dim)


class SyntheticStates:
    """A hybrid model's synthetic mamba states: every value a deterministic
    function of the page-hash chain through the state's position, the (global)
    layer and the element (this rank's share of the state: elements
    ``[tp_rank * elems, (tp_rank + 1) * elems)``)."""

    def __init__(self, shard: Shard, layer_ids: list[int], elems: int) -> None:
        layer = torch.tensor(layer_ids, dtype=torch.int64)
        first = shard.rank.tp * elems
        elem = torch.arange(first, first + elems)
        self.salt = (layer.view(-1, 1) * 0x1B873593 + elem.view(1, -1) * 0x6A09E667) & _MASK

    def state(self, chain_hash: bytes) -> torch.Tensor:
        """``(layers, elems)`` float32 values in ``[-0.5, 0.5)``."""
        code = int.from_bytes(chain_hash[:4], "little") & _MASK
        x = ((self.salt ^ code) * 0x2127599B) & _MASK
        return ((x >> 7) % 8191).to(torch.float32) / 8191 - 0.5
