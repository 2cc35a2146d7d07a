"""A real hybrid model behind the ranks (docs/hybrid-design.md): ``build_hybrid``
makes one, ``HybridKV`` fills a rank's pools with what it computes, and
``served_states`` puts a served prefix back together as the model's cache. The
layer states themselves are in ``fabric.rank.layer_state``; the split of a
recurrent state over TP ranks in ``fabric.rank.state_layout``. Needs the
``model`` extra (transformers).
"""

from __future__ import annotations

from typing import Any

import torch

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, unpack_tokens
from fabric.config import ModelConfig
from fabric.errors import ConfigError, InvalidInput
from fabric.rank.hybrid_fork import Forks
from fabric.rank.layer_state import (
    KINDS,
    FullKV,
    LayerState,
    MambaState,
    SlidingKV,
    component_bytes,
    extract,
    layer_kinds,
    rebuild,
)
from fabric.rank.model import cache_rtol
from fabric.rank.producer import ShardPositions
from fabric.rank.state_layout import StateLayout
from fabric.topology import Shard

__all__ = [
    "KINDS",
    "FullKV",
    "HybridKV",
    "LayerState",
    "MambaState",
    "SlidingKV",
    "build_hybrid",
    "component_bytes",
    "extract",
    "layer_kinds",
    "rebuild",
    "served_states",
]


def build_hybrid(model: ModelConfig) -> tuple[Any, Any]:
    """A tiny seeded-random transformers model whose layers follow
    ``model.layer_kinds``: Gemma 3 for full + sliding layers (window
    ``model.sliding_window``); for full + mamba layers Bamba (Mamba2), or
    Qwen3-Next (gated delta nets, with its mixture of experts) when
    ``model.recurrent_layer`` is ``gated_delta_net``. Returns ``(hf_config,
    model)`` in float32 eval mode."""
    from fabric.rank.model import _transformers

    tf = _transformers()
    kinds = list(model.kinds)
    if "mamba" in kinds and "sliding" in kinds:
        raise ConfigError(
            "model.filler=hybrid is refused for sliding and mamba layers together: allowed is "
            "full with sliding layers (Gemma 3) or full with mamba layers (Bamba, Qwen3-Next)"
        )
    heads = model.attention_heads or 2 * model.kv_heads
    hidden = heads * model.head_dim
    common = {
        "vocab_size": model.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": model.intermediate_size or 2 * hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model.kv_heads,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,  # tied, greedy output degenerates at this size
    }
    if "mamba" not in kinds:
        cfg = tf.Gemma3TextConfig(
            **common,
            head_dim=model.head_dim,
            sliding_window=max(2, model.sliding_window),
            layer_types=[f"{k}_attention" for k in kinds],
        )
        cls = tf.Gemma3ForCausalLM
    elif model.recurrent_layer == "gated_delta_net":
        cfg, cls = _qwen3_next(tf, model, common), tf.Qwen3NextForCausalLM
    else:
        cfg = tf.BambaConfig(
            **common,
            attn_layer_indices=[i for i, k in enumerate(kinds) if k == "full"],
            mamba_n_heads=8,
            mamba_d_head=2 * hidden // 8,
            mamba_n_groups=2,  # B and C split over TP ranks by group, as engines do
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
        )
        cls = tf.BambaForCausalLM
    torch.manual_seed(model.seed)
    return cfg, cls(cfg).eval()


def _qwen3_next(tf: Any, model: ModelConfig, common: dict[str, Any]) -> Any:
    """A Qwen3-Next config: gated delta nets where ``model.kinds`` says ``mamba``,
    key heads as many as the KV heads (so they split over TP ranks the same way)."""
    hidden = common["hidden_size"]
    return tf.Qwen3NextConfig(
        **common,
        head_dim=model.head_dim,
        layer_types=["full_attention" if k == "full" else "linear_attention" for k in model.kinds],
        linear_num_key_heads=model.kv_heads,
        linear_num_value_heads=2 * model.kv_heads,
        linear_key_head_dim=model.head_dim,
        linear_value_head_dim=model.head_dim,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        decoder_sparse_step=1,
    )


def mamba_state_floats(hf_config: Any) -> int:
    """float32 values of one recurrent layer's state (conv + recurrent)."""
    return StateLayout.of(hf_config).floats


def check_mamba_tp(c: Any, tp: int) -> None:
    """A recurrent layer splits over ``tp`` ranks only by whole heads and groups."""
    StateLayout.of(c).check_tp(tp)


def mamba_share(c: Any, state: MambaState, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s share of one layer's state, flat (``StateLayout.share``):
    what that rank of a TP engine computes and holds."""
    return StateLayout.of(c).share(state.conv, state.recurrent, tp_rank, tp)


def mamba_from_shares(c: Any, shares: list[torch.Tensor], kernel: int) -> MambaState:
    """One layer's state put back together from every TP rank's ``mamba_share``."""
    conv, recurrent = StateLayout.of(c).from_shares(shares)
    return MambaState(conv, recurrent, kernel)


class HybridKV(ShardPositions):
    """Fills a rank's pools with what a real hybrid model computes (``build_hybrid``):
    the full-attention layers' KV of its positions and heads, and for a compute's
    parts the sliding layers' KV of whole pages and the mamba layers' states at
    page-aligned ends (this rank's TP share of each: ``mamba_share``).
    A rank holding the whole model of full and mamba layers computes from the
    cache (``fabric.rank.hybrid_fork``: it forks the cached state and runs the new
    tokens only); other ranks run the whole model over the whole prefix."""

    tolerance = 1e-4  # with ``rtol`` (``cache_rtol``): as ``LlamaKV``'s, for the same reasons

    def __init__(
        self, shard: Shard, model: ModelConfig, page_size: int, elems: int, tp: int
    ) -> None:
        super().__init__(shard, page_size)
        self.rtol = cache_rtol(model.dtype)
        self.tp = tp
        self.head_dim = model.head_dim
        self.hf_config, self.model = build_hybrid(model)
        self.kinds = list(model.kinds)
        self.elems = elems
        span = range(shard.layer_start, shard.layer_start + shard.layers)
        self.full = [i for i in span if self.kinds[i] == "full"]
        self.sliding = [i for i in span if self.kinds[i] == "sliding"]
        self.mamba = [i for i in span if self.kinds[i] == "mamba"]
        self.heads = slice(shard.head_start, shard.head_start + shard.heads)
        floats = mamba_state_floats(self.hf_config) if "mamba" in self.kinds else 0
        if floats:
            check_mamba_tp(self.hf_config, tp)
        if floats and (model.mamba_state_bytes != 4 * floats or elems * self.tp != floats):
            raise ConfigError(
                f"model.mamba_state_bytes={model.mamba_state_bytes} is refused for this model: "
                f"allowed is {4 * floats} (a layer's conv and recurrent state in float32, "
                "split evenly over topology.tp)"
            )
        # Tokens run through the model: the whole prefix for each computed
        # value, the new tokens only for a compute from the cache.
        self.run_tokens = 0
        self.forks = Forks(self) if Forks.eligible(self, model.layers, model.kv_heads) else None

    def attach(self, states: Any, sliding: Any) -> None:
        """The rank's L1 mamba slots and sliding pages, which a compute from the
        cache forks."""
        if self.forks is not None:
            self.forks.attach(states, sliding)

    def compute(self, pool: Any, cmd: Any) -> bool:
        """Compute ``cmd`` from the cache where this rank can; ``False``: the caller
        fills from the whole prefix."""
        return self.forks is not None and self.forks.run(pool, cmd)

    def _run(self, ids: list[int]) -> Any:
        """The model's cache after ``ids``: every position's K and V in each attention
        layer (a config-less cache keeps all of a sliding layer's), the mamba states."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf_config) if "mamba" in self.kinds else DynamicCache()
        positions = torch.arange(len(ids)).unsqueeze(0)
        self.run_tokens += len(ids)
        with torch.no_grad():
            x = torch.tensor([ids], dtype=torch.long)
            out = self.model(x, cache=cache, use_cache=True, position_ids=positions)
        return out.past_key_values

    def _kv(self, cache: Any, layers: list[int], positions: torch.Tensor) -> torch.Tensor:
        """``(2, T, layers, heads, head_dim)`` of ``layers`` at ``positions``."""
        k = torch.stack([cache.layers[i].keys[0, self.heads][:, positions] for i in layers])
        v = torch.stack([cache.layers[i].values[0, self.heads][:, positions] for i in layers])
        # (layers, heads, T, dim) -> (T, layers, heads, dim)
        return torch.stack([k, v]).permute(0, 3, 1, 2, 4)

    def expected(self, prev_hash, tokens, start_token, dtype, prefix=b""):
        ids = unpack_tokens(prefix + tokens)
        positions = self.positions(start_token, start_token + len(tokens) // TOKEN_BYTES)
        if positions.numel() == 0 or not self.full:
            dim = self.head_dim
            return positions, torch.zeros(2, len(positions), len(self.full), self.shard.heads, dim)
        return positions, self._kv(self._run(ids), self.full, positions).to(dtype)

    def store_parts(self, sliding_pool: Any, states: Any, cmd: Any) -> None:
        """Store a compute's sliding pages and mamba states (``cmd.prefix``: every
        token up to the end of the compute's fill)."""
        ids = unpack_tokens(cmd.prefix)
        ps, cache = self.page_size, None
        for part in cmd.sliding if self.sliding else ():
            positions = self.positions(part.page * ps, (part.page + 1) * ps)
            values = None
            if self.forks is not None:  # the page a compute from the cache kept
                values = self.forks.take(
                    chain_hashes(part.prev_hash, part.tokens, ps * TOKEN_BYTES)[-1]
                )
            if values is None:  # not from a compute from the cache: the whole prefix runs
                cache = self._run(ids) if cache is None else cache
                values = self._kv(cache, self.sliding, positions)
            page_idx, offsets = self.locate(positions, part.page * ps, [part.pool_page])
            sliding_pool.write_tokens(page_idx, offsets, values)
        for part in cmd.mamba if self.mamba else ():
            kept = None if self.forks is None else self.forks.take(part.chain_hash)
            # The state a compute from the cache passed there, else from the prefix.
            states.buffer[part.slot] = kept if kept is not None else self._state(ids, part.end_page)

    def _state(self, ids: list[int], end_page: int) -> torch.Tensor:
        """This rank's share of every mamba layer's state after ``end_page`` pages
        of ``ids``, ``(layers, elems)``, as a slot holds it."""
        c, tp_rank = self.hf_config, self.shard.rank.tp
        layers = extract(self._run(ids[: end_page * self.page_size]), self.kinds)
        return torch.stack(
            [mamba_share(c, layers[i], tp_rank, self.tp) for i in self.mamba]  # type: ignore[arg-type]
        )

    def expected_parts(
        self, tokens: bytes, sliding: list[tuple[int, int]], mamba: list[tuple[int, int]]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What ``Parts.read`` must give for the packed prefix ``tokens``: the sliding
        layers' KV of the ``(key page, pool page)`` pages and the mamba states at
        the ``(end page, slot)`` ends, as a fresh run computes them (``None``
        where there are none on this rank)."""
        ids, ps = unpack_tokens(tokens), self.page_size
        kv = states = None
        if sliding and self.sliding:
            cache = self._run(ids[: (max(k for k, _ in sliding) + 1) * ps])
            at = torch.cat([self.positions(k * ps, (k + 1) * ps) for k, _ in sliding])
            kv = self._kv(cache, self.sliding, at)
        if mamba and self.mamba:
            states = torch.stack([self._state(ids, end) for end, _ in mamba])
        return kv, states


# -- a served prefix back as a model's cache ---------------------------------------


def served_states(
    model: ModelConfig,
    hf_config: Any,
    page_size: int,
    end_page: int,
    full: list[tuple[Shard, torch.Tensor]],
    parts: list[tuple[Shard, torch.Tensor | None, torch.Tensor | None]],
    sliding: list[tuple[int, int]],
) -> list[LayerState]:
    """Every layer's state after the first ``end_page`` pages of a served prefix,
    put together from every rank's shard: ``full`` as ``RankWorker.read`` returns
    it (the full-attention layers' KV of the prefix's positions), ``parts`` as
    ``Parts.read`` returns it for the lease's ``sliding`` ``(key page, pool
    page)`` pages and the mamba states of the lease's slots, the last one at
    ``end_page``. ``rebuild`` makes the
    cache a model continues from at position ``end_page * page_size``. Raises
    ``InvalidInput`` when a rank's share of a layer is missing (the lease did
    not hold a component there)."""
    kinds = list(model.kinds)
    cut = end_page * page_size
    window = range(max(0, cut - max(0, model.sliding_window - 1)), cut)
    kv: dict[int, dict[int, torch.Tensor]] = {}  # layer -> position -> (2, kv_heads, dim)
    states: dict[int, dict[int, torch.Tensor]] = {}  # mamba layer -> TP rank -> share
    for (shard, values), (_, skv, mamba) in zip(full, parts, strict=True):
        span = range(shard.layer_start, shard.layer_start + shard.layers)
        heads = slice(shard.head_start, shard.head_start + shard.heads)
        at = ShardPositions(shard, page_size)
        positions = at.positions(0, cut)
        for j, layer in enumerate(i for i in span if kinds[i] == "full"):
            _put(kv, layer, positions, values[:, : len(positions), j], heads, model)
        if skv is not None:
            spos = torch.cat([at.positions(k * page_size, (k + 1) * page_size) for k, _ in sliding])
            for j, layer in enumerate(i for i in span if kinds[i] == "sliding"):
                _put(kv, layer, spos, skv[:, :, j], heads, model)
        for j, layer in enumerate(i for i in span if kinds[i] == "mamba"):
            if mamba is None or not len(mamba):
                raise InvalidInput(f"no mamba state for layer {layer} at page {end_page}")
            states.setdefault(layer, {})[shard.rank.tp] = mamba[-1, j]
    out: list[LayerState] = []
    kernel = StateLayout.of(hf_config).kernel if "mamba" in kinds else 0
    for i, kind in enumerate(kinds):
        if kind == "mamba":
            shares = states.get(i, {})
            if len(shares) != len({shard.rank.tp for shard, _ in full}):
                raise InvalidInput(f"layer {i} (mamba) lacks a TP rank's share of its state")
            out.append(mamba_from_shares(hf_config, [shares[t] for t in sorted(shares)], kernel))
            continue
        want = range(cut) if kind == "full" else window
        got = kv.get(i, {})
        if any(p not in got for p in want):
            raise InvalidInput(f"layer {i} ({kind}) lacks positions of the first {cut} tokens")
        stacked = torch.stack([got[p] for p in want], dim=2)  # (2, kv_heads, T, dim)
        if bool(stacked.isnan().any()):
            raise InvalidInput(f"layer {i} ({kind}) lacks some heads' KV")
        k, v = stacked[0].unsqueeze(0), stacked[1].unsqueeze(0)
        out.append(SlidingKV(k, v, cut) if kind == "sliding" else FullKV(k, v))
    return out


def _put(
    kv: dict[int, dict[int, torch.Tensor]],
    layer: int,
    positions: torch.Tensor,
    values: torch.Tensor,  # (2, T, heads, dim) over ``positions``
    heads: slice,
    model: ModelConfig,
) -> None:
    """Place one rank's heads of ``layer`` at ``positions``."""
    rows = kv.setdefault(layer, {})
    for n, p in enumerate(positions.tolist()):
        row = rows.get(p)
        if row is None:
            row = rows[p] = torch.full((2, model.kv_heads, model.head_dim), float("nan"))
        row[:, heads] = values[:, n].float()
