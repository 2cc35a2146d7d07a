"""A real transformer behind the ranks, and KV read back for a driver.

``LlamaKV`` is a Llama-architecture model behind a rank: seeded random weights
of ``model.*``'s shape (nothing downloaded), or the weights in ``model.path``.
It recomputes a rank's shard of the KV (its layers, its KV heads, its positions
of each page) with the whole model over the whole sequence: what checks compare
against. The ranks themselves compute from the cache, each its share of the new
tokens only (``fabric.rank.sharded``). Eager attention.

``assemble`` puts every rank's shard of a lease back together per layer, and
``to_cache`` makes a ``transformers`` cache of it, so a driver continues
generation from KV the fabric served. ``transformers`` is an optional extra
(``pip install 'kvfabric[model]'``), imported only here and only when used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fabric.cache.keys import TOKEN_BYTES, unpack_tokens
from fabric.config import ModelConfig
from fabric.errors import ConfigError
from fabric.rank.pools import DTYPES
from fabric.rank.producer import ShardPositions
from fabric.topology import Shard


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.filler=llama needs Hugging Face transformers: pip install 'kvfabric[model]'"
        ) from None
    return transformers


def build_model(model: ModelConfig) -> Any:
    """The Llama model ``model`` describes, in float32 eval mode: the weights in
    ``model.path``, or seeded random ones (the same on every rank and driver)."""
    tf = _transformers()
    if model.path:
        try:
            hf = tf.AutoModelForCausalLM.from_pretrained(
                model.path, dtype=torch.float32, attn_implementation="eager"
            )
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"model.path={model.path!r} cannot be loaded ({first}); set it to a local "
                "Hugging Face model directory, or leave it empty for random weights"
            ) from None
        cfg = hf.config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, hf_head_dim(cfg))
        want = (model.layers, model.kv_heads, model.head_dim)
        if shape != want:
            raise ConfigError(
                f"model.path={model.path!r} has layers, kv_heads, head_dim = {shape}; "
                f"the config says {want}: set model.layers, model.kv_heads, model.head_dim to match"
            )
        return hf.eval()
    heads = model.attention_heads or 2 * model.kv_heads
    if heads % model.kv_heads:
        raise ConfigError(
            f"model.attention_heads={heads} is refused: allowed is a multiple of "
            f"model.kv_heads ({model.kv_heads})"
        )
    hidden = heads * model.head_dim
    cfg = tf.LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=hidden,
        intermediate_size=model.intermediate_size or 2 * hidden,
        num_hidden_layers=model.layers,
        num_attention_heads=heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim,
        max_position_embeddings=1 << 16,
        initializer_range=model.initializer_range,
        attn_implementation="eager",
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(model.seed)
        return tf.LlamaForCausalLM(cfg).eval()
    finally:
        torch.random.set_rng_state(state)


def within(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether ``actual`` is ``expected`` up to float32 noise: every element within
    ``atol + rtol * max|expected|``. The bound scales with the tensor's largest
    value, not each element's own: rounding in a long sum is relative to the
    terms summed, so a small result of large terms carries their absolute noise."""
    if actual.shape != expected.shape:
        return False
    if not expected.numel():
        return True
    scale = float(expected.abs().max())
    return float((actual.float() - expected.float()).abs().max()) <= atol + rtol * scale


# A value computed from the 16-bit KV of its prefix (what a rank computing from a
# bfloat16 or float16 cache does) drifts from a float32 recomputation by up to ~15
# machine epsilons of the tensor's largest value (tiny-llama at TP1 and TP2 with
# prompts up to 1,500 tokens in 32-token chunks; Bamba's and Qwen3-Next's states
# less): a model filler's check allows twice that on a 16-bit cache.
LOW_PRECISION_EPSILONS = 32


def cache_rtol(dtype: str) -> float:
    """The ``rtol`` of a model filler's check (``within``) for a cache of ``dtype``
    (``model.dtype``): 1e-4 for float32 (its rounding noise), else
    ``LOW_PRECISION_EPSILONS`` of the dtype's epsilon (0.25 for bfloat16, 0.03 for
    float16) — a value of another prefix is off by about the largest value."""
    return max(1e-4, LOW_PRECISION_EPSILONS * torch.finfo(DTYPES[dtype]).eps)


def hf_head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@torch.no_grad()
def model_kv(hf: Any, ids: Sequence[int]) -> torch.Tensor:
    """The KV of ``ids`` from scratch: ``(2, layers, kv_heads, len(ids), head_dim)``."""
    if not ids:
        raise ValueError("no tokens")
    out = hf(input_ids=torch.tensor([list(ids)], dtype=torch.int64), use_cache=True)
    layers = out.cache.layers
    keys = torch.stack([layer.keys[0] for layer in layers])
    values = torch.stack([layer.values[0] for layer in layers])
    return torch.stack((keys, values))


class LlamaKV(ShardPositions):
    """A ``KVFiller`` backed by a Llama model that recomputes (see the module
    docstring): ``expected`` runs the whole model over the prefix and the new
    tokens and gives this shard's KV of the new ones — the check's reference, and
    what the inherited ``fill`` stores.

    Float32 KV depends on how a sequence is cut into runs in its last bits
    (matrix kernels round differently for other shapes): a recomputation
    matches within ``tolerance + rtol * max|expected|``, not bit for bit. KV
    values reach tens, and the rounding of a sum is relative to its terms: an
    absolute bound alone fails correct KV now and then (3 of 1,000 checks of
    tiny-llama at TP1 with ``rtol`` 0). A 16-bit cache's KV is held to
    ``cache_rtol``'s wider bound."""

    tolerance = 1e-4

    def __init__(self, shard: Shard, model: ModelConfig, page_size: int) -> None:
        super().__init__(shard, page_size)
        self.rtol = cache_rtol(model.dtype)
        self.model = build_model(model)

    def expected(
        self,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        dtype: torch.dtype,
        prefix: bytes = b"",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(prefix) != start_token * TOKEN_BYTES:
            raise ValueError(
                f"the model needs the {start_token} tokens before the compute, got "
                f"{len(prefix) // TOKEN_BYTES}"
            )
        end = start_token + len(tokens) // TOKEN_BYTES
        positions = self.positions(start_token, end)
        if positions.numel() == 0:
            return positions, torch.empty(0)
        kv = model_kv(self.model, unpack_tokens(prefix + tokens))
        s = self.shard
        mine = kv[
            :, s.layer_start : s.layer_start + s.layers, s.head_start : s.head_start + s.heads
        ]
        # (2, layers, heads, T, dim) -> (2, T, layers, heads, dim)
        return positions, mine[:, :, :, positions].permute(0, 3, 1, 2, 4).to(dtype)


def assemble(
    shards: Sequence[tuple[Shard, torch.Tensor]], model: ModelConfig, page_size: int, tokens: int
) -> torch.Tensor:
    """Every rank's shard of a lease's KV (as ``RankWorker.read`` returns it:
    ``(2, T, layers, heads, head_dim)`` over that rank's positions) as one
    ``(2, layers, kv_heads, tokens, head_dim)`` float32 tensor."""
    out = torch.zeros(2, model.layers, model.kv_heads, tokens, model.head_dim)
    seen = torch.zeros(model.layers, model.kv_heads, tokens, dtype=torch.bool)
    for shard, values in shards:
        pos = ShardPositions(shard, page_size).positions(0, tokens)
        layers = slice(shard.layer_start, shard.layer_start + shard.layers)
        heads = slice(shard.head_start, shard.head_start + shard.heads)
        out[:, layers, heads][:, :, :, pos] = values.permute(0, 2, 3, 1, 4).float()
        seen[layers, heads][:, :, pos] = True
    if not bool(seen.all()):
        raise ValueError("the shards do not cover every layer, head and position")
    return out


def to_cache(kv: torch.Tensor, hf: Any) -> Any:
    """A ``transformers`` ``DynamicCache`` holding ``kv`` ``(2, layers, heads,
    tokens, head_dim)`` for one sequence, for ``hf``'s ``generate(cache=...)``."""
    tf = _transformers()
    cache = tf.DynamicCache(config=hf.config)
    for layer in range(kv.shape[1]):
        cache.update(kv[0, layer].unsqueeze(0).clone(), kv[1, layer].unsqueeze(0).clone(), layer)
    return cache
