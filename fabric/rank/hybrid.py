"""What a hybrid model's cache holds per layer, taken out of a transformers
cache and put back: the data-plane half of hybrid support (docs/hybrid-design.md).

A layer is one of three kinds (``layer_kinds``), each a cache component:

- ``full`` (full attention): K and V of every token;
- ``sliding`` (sliding-window attention): K and V of the last ``window - 1``
  tokens only, and the prefix length they end — transformers records it as the
  layer's ``cumulative_length``, and a rebuilt layer serves correctly only if
  it is restored;
- ``mamba`` (a recurrent / linear-attention layer: Mamba2, gated delta net):
  one conv state and one recurrent state at the prefix's end.

``extract`` clones (the cache updates its tensors in place as it runs on);
``rebuild`` makes a cache a model continues from as if it had run the prefix.
Needs the ``model`` extra (transformers).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from fabric.cache.keys import TOKEN_BYTES, unpack_tokens
from fabric.config import ModelConfig
from fabric.errors import ConfigError, InvalidInput
from fabric.rank.producer import ShardPositions
from fabric.topology import Shard

KINDS = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "mamba"}


@dataclass(frozen=True)
class FullKV:
    keys: torch.Tensor  # (batch, kv_heads, tokens, head_dim)
    values: torch.Tensor


@dataclass(frozen=True)
class SlidingKV:
    keys: torch.Tensor  # the last window - 1 tokens
    values: torch.Tensor
    length: int  # the prefix length they end


@dataclass(frozen=True)
class MambaState:
    conv: torch.Tensor  # (batch, channels, kernel)
    recurrent: torch.Tensor  # (batch, heads, head_dim, state) or the model's own layout
    kernel: int


LayerState = FullKV | SlidingKV | MambaState


def layer_kinds(hf_config: Any) -> list[str]:
    """``full``, ``sliding`` or ``mamba`` for each layer of a transformers config."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:  # an attention-only model without per-layer types
        return ["full"] * hf_config.num_hidden_layers
    unknown = sorted({t for t in types if t not in KINDS})
    if unknown:
        raise InvalidInput(
            f"layer type(s) {', '.join(map(repr, unknown))} are not supported: allowed are "
            f"{', '.join(sorted(KINDS))}"
        )
    return [KINDS[t] for t in types]


def extract(cache: Any, kinds: list[str]) -> list[LayerState]:
    """Each layer's state in ``cache`` (a transformers ``DynamicCache`` after a
    prefix), cloned."""
    if len(cache.layers) != len(kinds):
        raise InvalidInput(f"the cache has {len(cache.layers)} layers, the model {len(kinds)}")
    out: list[LayerState] = []
    for layer, kind in zip(cache.layers, kinds, strict=True):
        if kind == "mamba":
            out.append(
                MambaState(
                    layer.conv_states[0].clone(),
                    layer.recurrent_states[0].clone(),
                    int(layer.conv_kernel_size[0]),
                )
            )
        elif kind == "sliding":
            out.append(
                SlidingKV(layer.keys.clone(), layer.values.clone(), int(layer.cumulative_length))
            )
        else:
            out.append(FullKV(layer.keys.clone(), layer.values.clone()))
    return out


def rebuild(states: list[LayerState], hf_config: Any) -> Any:
    """A ``DynamicCache`` holding ``states``: a model run on it continues the
    prefix they were extracted after (pass explicit ``position_ids`` from the
    prefix length on)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_config)
    if len(cache.layers) != len(states):
        raise InvalidInput(f"{len(states)} layer states for a model of {len(cache.layers)} layers")
    for layer, state in zip(cache.layers, states, strict=True):
        if isinstance(state, MambaState):
            layer.lazy_initialization(
                conv_states=state.conv,
                recurrent_states=state.recurrent,
                conv_kernel_size=state.kernel,
            )
            layer.conv_states[0] = state.conv.clone()
            layer.recurrent_states[0] = state.recurrent.clone()
            layer.has_previous_state[0] = True
        else:
            layer.lazy_initialization(state.keys, state.values)
            layer.keys, layer.values = state.keys.clone(), state.values.clone()
            if isinstance(state, SlidingKV):
                layer.cumulative_length = state.length
    return cache


def component_bytes(states: list[LayerState]) -> dict[str, int]:
    """Bytes each component holds for one prefix (what the cache must keep)."""
    out: Counter[str] = Counter({"full": 0, "sliding": 0, "mamba": 0})
    for s in states:
        if isinstance(s, MambaState):
            tensors, kind = (s.conv, s.recurrent), "mamba"
        else:
            tensors, kind = (s.keys, s.values), "sliding" if isinstance(s, SlidingKV) else "full"
        out[kind] += sum(t.numel() * t.element_size() for t in tensors)
    return dict(out)


# -- a real hybrid model behind the ranks ------------------------------------------


def build_hybrid(model: ModelConfig) -> tuple[Any, Any]:
    """A tiny seeded-random transformers model whose layers follow
    ``model.layer_kinds``: Gemma 3 for full + sliding layers (window
    ``model.sliding_window``), Bamba (Mamba2) for full + mamba layers. Returns
    ``(hf_config, model)`` in float32 eval mode."""
    from fabric.rank.model import _transformers

    tf = _transformers()
    kinds = list(model.kinds)
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
    if "mamba" in kinds and "sliding" in kinds:
        raise ConfigError(
            "model.filler=hybrid is refused for sliding and mamba layers together: allowed is "
            "full with sliding layers (Gemma 3) or full with mamba layers (Bamba)"
        )
    if "mamba" in kinds:
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
    else:
        cfg = tf.Gemma3TextConfig(
            **common,
            head_dim=model.head_dim,
            sliding_window=max(2, model.sliding_window),
            layer_types=[f"{k}_attention" for k in kinds],
        )
        cls = tf.Gemma3ForCausalLM
    torch.manual_seed(model.seed)
    return cfg, cls(cfg).eval()


def mamba_state_floats(hf_config: Any) -> int:
    """float32 values of one mamba layer's state (conv + recurrent) in a Bamba model."""
    c = hf_config
    inner = c.mamba_expand * c.hidden_size
    conv = (inner + 2 * c.mamba_n_groups * c.mamba_d_state) * c.mamba_d_conv
    return conv + c.mamba_n_heads * c.mamba_d_head * c.mamba_d_state


def _conv_channels(c: Any, tp_rank: int, tp: int) -> torch.Tensor:
    """The conv state channels TP rank ``tp_rank`` of ``tp`` holds in a Mamba2 layer:
    its heads' share of the ``x`` channels and its groups' share of ``B`` and ``C``
    (the channel order ``[x | B | C]`` of the layer's in-projection)."""
    inner, groups, ds = c.mamba_n_heads * c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state
    x = torch.arange(inner).view(tp, -1)[tp_rank]
    b = inner + torch.arange(groups * ds).view(tp, -1)[tp_rank]
    return torch.cat([x, b, b + groups * ds])


def check_mamba_tp(c: Any, tp: int) -> None:
    """A Mamba2 layer splits over ``tp`` ranks only by whole heads and groups."""
    if c.mamba_n_heads % tp or c.mamba_n_groups % tp:
        raise ConfigError(
            f"topology.tp={tp} is refused for this model's mamba layers: allowed is a "
            f"divisor of both its {c.mamba_n_heads} heads and {c.mamba_n_groups} groups"
        )


def mamba_share(c: Any, state: MambaState, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s share of one layer's state, flat: the conv state of
    its channels (``_conv_channels``), then the recurrent state of its heads —
    what that rank of a TP engine computes and holds."""
    heads = c.mamba_n_heads // tp
    conv = state.conv[0, _conv_channels(c, tp_rank, tp)]
    recurrent = state.recurrent[0, tp_rank * heads : (tp_rank + 1) * heads]
    return torch.cat([conv.flatten(), recurrent.flatten()])


def mamba_from_shares(c: Any, shares: list[torch.Tensor], kernel: int) -> MambaState:
    """One layer's state put back together from every TP rank's ``mamba_share``."""
    tp = len(shares)
    inner, groups, ds = c.mamba_n_heads * c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state
    channels = inner + 2 * groups * ds
    conv = torch.empty(1, channels, kernel)
    recurrent = torch.empty(1, c.mamba_n_heads, c.mamba_d_head, ds)
    heads = c.mamba_n_heads // tp
    for r, flat in enumerate(shares):
        idx = _conv_channels(c, r, tp)
        n = len(idx) * kernel
        conv[0, idx] = flat[:n].view(len(idx), kernel)
        recurrent[0, r * heads : (r + 1) * heads] = flat[n:].view(heads, c.mamba_d_head, ds)
    return MambaState(conv, recurrent, kernel)


class HybridKV(ShardPositions):
    """Fills a rank's pools with what a real hybrid model computes (``build_hybrid``):
    the full-attention layers' KV of its positions and heads, and for a compute's
    parts the sliding layers' KV of whole pages and the mamba layers' states at
    page-aligned ends (this rank's TP share of each: ``mamba_share``).
    A rank holding the whole model of full and mamba layers computes from the
    cache (``fabric.rank.hybrid_fork``: it forks the cached state and runs the new
    tokens only); other ranks run the whole model over the whole prefix."""

    tolerance = 1e-4  # with ``rtol``: as ``LlamaKV``'s, for the same float32 reasons
    rtol = 1e-4

    def __init__(
        self, shard: Shard, model: ModelConfig, page_size: int, elems: int, tp: int
    ) -> None:
        super().__init__(shard, page_size)
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
        from fabric.rank.hybrid_fork import Forks

        self.forks = Forks(self) if Forks.eligible(self, model.layers, model.kv_heads) else None

    def attach_states(self, states: Any) -> None:
        """The rank's L1 mamba slots, which a compute from the cache forks."""
        if self.forks is not None:
            self.forks.attach(states)

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
        ps = self.page_size
        if cmd.sliding and self.sliding:
            cache = self._run(ids)
            for part in cmd.sliding:
                positions = self.positions(part.page * ps, (part.page + 1) * ps)
                values = self._kv(cache, self.sliding, positions)
                page_idx, offsets = self.locate(positions, part.page * ps, [part.pool_page])
                sliding_pool.write_tokens(page_idx, offsets, values)
        c, tp_rank = self.hf_config, self.shard.rank.tp
        for part in cmd.mamba if self.mamba else ():
            kept = None if self.forks is None else self.forks.take(part.chain_hash)
            if kept is not None:  # the state a compute from the cache passed there
                states.buffer[part.slot] = kept
                continue
            cache = self._run(ids[: part.end_page * ps])
            layers = extract(cache, self.kinds)
            states.buffer[part.slot] = torch.stack(
                [mamba_share(c, layers[i], tp_rank, self.tp) for i in self.mamba]  # type: ignore[arg-type]
            )


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
    kernel = getattr(hf_config, "mamba_d_conv", 0)
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
