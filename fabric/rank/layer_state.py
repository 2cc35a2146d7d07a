"""What a hybrid model's cache holds per layer, taken out of a transformers
cache and put back (docs/hybrid-design.md; ``fabric.rank.hybrid`` runs the model).

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

from fabric.errors import InvalidInput

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
