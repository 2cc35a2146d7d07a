"""A hybrid model's compute from the cache, on a rank that holds the whole model
(TP = PP = CP = 1) of full-attention layers and either mamba or sliding-window
layers.

A compute starts where the request's cached prefix ends. Its first command names
the L1 state there: the mamba slot (``Compute.from_state``) or the sliding pages
of the window before it (``Compute.window``). The rank forks it: the request's
run gets its own copy of that state (with the prefix's full-attention KV from
L1) and advances the copy through the new tokens only. The slot and the pages
are the cache's and are never written by the run, so they keep serving their
prefix — to this request's later turns and to any other request forking from it
(copy-on-write, as an engine forks a running request's state slot from a cached
one). A sliding layer's run holds every position, zeros before the window (the
sliding mask never reads them), so the KV of every new token is there to store.

It runs the new tokens in pieces that end where the cache stores a mamba state
(node ends, checkpoints: the command's ``states_at``) and keeps what the parts
commands that follow store — each such state, each such sliding page — by its
page-hash chain (``snapshots``): they store it from there instead of running
the prefix again. A compute cut in chunks continues from the run the chunk
before left, and a decode step from the run the step before left (``running``,
by the chain hash and the tokens where it stopped; a first chunk always forks
the cached state). Both are bounded; what is not found there is
computed from the whole prefix, as ranks of other shapes do.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, unpack_tokens
from fabric.messages import Compute
from fabric.rank.layer_state import FullKV, LayerState, MambaState, rebuild
from fabric.rank.pools import KVPool, StatePool
from fabric.rank.state_layout import StateLayout


class Forks:
    # Runs kept for the next chunk or decode step — of several requests at once,
    # so within a byte budget (each holds its prefix's KV; the newest is always
    # kept) — and states kept for a compute's parts (one compute's at a time).
    # The oldest go first past the bound.
    RUNNING_BYTES = 256 << 20
    SNAPSHOTS = 1024

    def __init__(self, kv: Any) -> None:
        """``kv``: the rank's ``HybridKV`` (its model, layers and positions)."""
        self.kv = kv
        self.states: StatePool | None = None  # the rank's L1 mamba slots (``attach``)
        self.sliding: KVPool | None = None  # and its L1 sliding pages
        self.running: OrderedDict[bytes, Any] = OrderedDict()
        self.running_bytes: dict[bytes, int] = {}
        self.snapshots: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.forked = 0  # computes that started from a cached state slot
        self.pieces = 0  # the model's forward calls

    @staticmethod
    def eligible(kv: Any, layers: int, kv_heads: int) -> bool:
        """Whether ``kv``'s rank holds the whole model and the model does not mix
        sliding and mamba layers (a model cache that runs mamba layers keeps only
        a sliding layer's window)."""
        shard = kv.shard
        return (
            shard.layers == layers
            and shard.heads == kv_heads
            and shard.page_tokens == kv.page_size
            and not (kv.sliding and kv.mamba)
        )

    def attach(self, states: StatePool | None, sliding: KVPool | None) -> None:
        self.states, self.sliding = states, sliding

    def fork(self, slot: int) -> list[Any]:
        """The request's own copy of each mamba layer's state in ``slot``."""
        assert self.states is not None
        flat = self.states.buffer[slot].detach().to("cpu", torch.float32, copy=True)
        layout = StateLayout.of(self.kv.hf_config)
        return [
            MambaState(*layout.from_shares([flat[j]]), layout.kernel)
            for j in range(len(self.kv.mamba))
        ]

    def _start(self, pool: KVPool, cmd: Compute) -> Any | None:
        """The model's cache at ``cmd.start_token``, the request's own; ``None`` when
        there is no cached state to start from."""
        kv, start, ps = self.kv, cmd.start_token, self.kv.page_size
        if start == 0:
            return self._cache([])
        if not (cmd.from_state or cmd.window):  # a later chunk: the run the one before left
            return self._take_running(cmd.prev_hash)
        held = list(cmd.prefix_pages)[: start // ps]
        if len(held) * ps < start or (kv.mamba and not cmd.from_state):
            return None
        full = _read(pool, kv, held, 0, start)  # (2, T, full layers, heads, dim)
        sliding = None
        if kv.sliding:
            lo = start - len(cmd.window) * ps
            if self.sliding is None or not cmd.window or lo < 0:
                return None
            sliding = torch.zeros(2, start, len(kv.sliding), *full.shape[3:])
            sliding[:, lo:] = _read(self.sliding, kv, list(cmd.window), lo, start)
        mamba = iter(self.fork(cmd.from_state[0]) if kv.mamba else ())
        states: list[LayerState] = []
        layers = {"full": iter(range(len(kv.full))), "sliding": iter(range(len(kv.sliding)))}
        for kind in kv.kinds:
            if kind == "mamba":
                states.append(next(mamba))
                continue
            j, values = next(layers[kind]), full if kind == "full" else sliding
            assert values is not None
            k, v = (values[n, :, j].permute(1, 0, 2).unsqueeze(0) for n in (0, 1))
            states.append(FullKV(k, v))
        self.forked += 1
        return self._cache(states)

    def _cache(self, states: list[LayerState]) -> Any:
        """A model cache holding ``states`` (empty: a new one). With mamba layers,
        the model's own (``rebuild``); without, one that keeps a sliding layer's
        every position, as a full layer's."""
        from transformers import DynamicCache

        if self.kv.mamba:
            return (
                rebuild(states, self.kv.hf_config)
                if states
                else DynamicCache(config=self.kv.hf_config)
            )
        cache = DynamicCache()
        for i, state in enumerate(states):
            assert isinstance(state, FullKV)
            cache.update(state.keys.clone(), state.values.clone(), i)
        return cache

    def run(self, pool: KVPool, cmd: Compute) -> bool:
        """Compute ``cmd``'s tokens from the cache into its pages; ``False`` (nothing
        done) when there is no cached state to start from. A decode step continues
        the run the step before left where it is still kept (``running``, by the
        chain hash where its page starts and the page's tokens before
        ``cmd.keep``); else its partial page runs from its start again (the tokens
        before ``cmd.keep`` run too, and are not written)."""
        kv, ps = self.kv, self.kv.page_size
        if not cmd.tokens:
            return False
        cache, done = None, 0
        if cmd.keep:
            cache = self._take_running(cmd.prev_hash + cmd.tokens[: cmd.keep * TOKEN_BYTES])
            done = cmd.keep if cache is not None else 0
        cache = self._start(pool, cmd) if cache is None else cache
        if cache is None:
            return False
        if cmd.start_token == 0 or cmd.from_state or cmd.window:
            # A compute's first command: the one before has stored its states (its
            # commands came in order), so what it kept is no longer asked for.
            self.snapshots.clear()
        ids = unpack_tokens(cmd.tokens)
        whole = len(ids) // ps
        hashes = chain_hashes(cmd.prev_hash, cmd.tokens[: whole * ps * TOKEN_BYTES], ps * 4)
        first = cmd.start_token // ps
        wanted = {e - first for e in cmd.states_at if 0 < e - first <= whole}
        cache = self._advance(cache, cmd.start_token, ids, done, wanted, hashes)
        for w in sorted(wanted) if kv.sliding else ():  # the sliding pages the parts store
            at = torch.arange(cmd.start_token + (w - 1) * ps, cmd.start_token + w * ps)
            self._keep(self.snapshots, hashes[w - 1], kv._kv(cache, kv.sliding, at).clone())
        positions = torch.arange(cmd.start_token + cmd.keep, cmd.start_token + len(ids))
        values = kv._kv(cache, kv.full, positions)
        page_idx, offsets = kv.locate(positions, cmd.start_token, list(cmd.pages))
        pool.write_tokens(page_idx, offsets, values)
        # Kept for the next chunk, or the next decode step of a partial page.
        page_start = hashes[whole - 1] if whole else cmd.prev_hash
        self._keep(self.running, page_start + cmd.tokens[whole * ps * TOKEN_BYTES :], cache)
        kv.computed_tokens += len(ids) - cmd.keep
        kv.run_tokens += len(ids) - done
        return True

    def _advance(
        self, cache: Any, start: int, ids: list[int], done: int, wanted: set[int], hashes: list
    ) -> Any:
        """``cache`` run on through ``ids[done:]`` (``ids`` from position ``start``),
        in pieces that end at the ``wanted`` page ends, where the mamba state is
        kept (every sliding position stays in the run)."""
        kv, ps = self.kv, self.kv.page_size
        ends = sorted({w * ps for w in wanted if kv.mamba and w * ps > done} | {len(ids)})
        with torch.no_grad():
            for end in ends:
                if end <= done:
                    continue
                positions = torch.arange(start + done, start + end).unsqueeze(0)
                x = torch.tensor([ids[done:end]], dtype=torch.long)
                cache = kv.model(x, cache=cache, use_cache=True, position_ids=positions)
                cache, done = cache.past_key_values, end
                self.pieces += 1
                if kv.mamba and end % ps == 0 and end // ps in wanted:
                    self._keep(self.snapshots, hashes[end // ps - 1], self.snapshot(cache))
        return cache

    def snapshot(self, cache: Any) -> torch.Tensor:
        """Every mamba layer's state in ``cache`` as a slot holds it (copied)."""
        layout, out = StateLayout.of(self.kv.hf_config), []
        for i in self.kv.mamba:
            layer = cache.layers[i]
            out.append(layout.share(layer.conv_states[0], layer.recurrent_states[0], 0, 1).clone())
        return torch.stack(out)

    def take(self, chain_hash: bytes) -> torch.Tensor | None:
        """What a run kept at the page end ``chain_hash`` — the mamba state there, or
        the sliding KV of the page before it — if it is still kept."""
        return self.snapshots.pop(chain_hash, None)

    def _keep(self, kept: OrderedDict, key: bytes, value: Any) -> None:
        kept[key] = value
        kept.move_to_end(key)
        if kept is self.snapshots:
            while len(kept) > self.SNAPSHOTS:
                kept.popitem(last=False)
            return
        self.running_bytes[key] = _cache_bytes(value)
        while len(kept) > 1 and sum(self.running_bytes.values()) > self.RUNNING_BYTES:
            self.running_bytes.pop(kept.popitem(last=False)[0])

    def _take_running(self, key: bytes) -> Any | None:
        self.running_bytes.pop(key, None)
        return self.running.pop(key, None)


def _read(pool: KVPool, kv: Any, pages: list[int], lo: int, hi: int) -> torch.Tensor:
    """``(2, hi - lo, layers, heads, dim)``: positions ``[lo, hi)`` from ``pool``'s
    ``pages`` (the key pages from ``lo``'s on), in float32 on the CPU."""
    page_idx, offsets = kv.locate(torch.arange(lo, hi), lo, pages)
    device = pool.buffer.device
    return pool.read_tokens(page_idx.to(device), offsets.to(device)).to("cpu", torch.float32)


def _cache_bytes(cache: Any) -> int:
    """The bytes of a model cache's tensors."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            if isinstance(value, dict):  # a recurrent layer's states, by batch index
                value = list(value.values())
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total
