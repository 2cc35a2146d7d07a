"""Small random-weight hybrid checkpoints vLLM serves with its hybrid KV cache
manager: seeded weights saved with ``save_pretrained``, and the tiny Llama's
tokenizer (``tiny_llama.save_tokenizer``).

- ``gemma3``: Gemma 3 text, three sliding-window layers (a window of 64 tokens
  in ``tiny``) then one full-attention layer, float32;
- ``qwen3next``: Qwen3-Next, three gated delta net (linear attention) layers then
  one full-attention layer, four experts, bfloat16 (vLLM's CPU gated delta net
  runs in bfloat16 only; head dims of 64: 32 is refused).

Sizes: ``tiny`` for the tests (2 KV heads, so TP=2 splits them); ``bench`` for
``bench/vllm_ttft.py --model gemma3|qwen3next`` (about the bench Llama's width:
hidden 1024, 8 layers, the window 512 tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.vllm_engine.tiny_llama import save_tokenizer

KINDS = ("gemma3", "qwen3next")
SIZES = {
    "tiny": {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "vocab": 512, "window": 64},
    "bench": {
        "hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 8, "vocab": 32000, "window": 512,
    },
}  # fmt: skip
# The dtype each kind runs in (vLLM's CPU gated delta net needs bfloat16).
DTYPES = {"gemma3": "float32", "qwen3next": "bfloat16"}


def make(directory: str | Path, kind: str, size: str = "tiny", seed: int = 0) -> Path:
    """Write the ``kind`` checkpoint of ``size`` and its tokenizer to ``directory``."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is refused: allowed is one of {KINDS}")
    dims = SIZES[size]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _gemma3(dims) if kind == "gemma3" else _qwen3next(dims)
    model.save_pretrained(out)
    save_tokenizer(out, dims["vocab"])
    return out


def _every_fourth(layers: int, other: str, full: str) -> list[str]:
    return [full if i % 4 == 3 else other for i in range(layers)]


def _gemma3(dims: dict):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["hidden"] * 2,
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        head_dim=dims["hidden"] // dims["heads"],
        sliding_window=dims["window"],
        layer_types=_every_fourth(dims["layers"], "sliding_attention", "full_attention"),
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    return Gemma3ForCausalLM(config)


def _qwen3next(dims: dict):
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    heads = max(dims["hidden"] // 64, 2)
    config = Qwen3NextConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["hidden"] * 2,
        num_hidden_layers=dims["layers"],
        num_attention_heads=heads,
        num_key_value_heads=dims["kv_heads"],
        head_dim=64,
        linear_num_key_heads=dims["kv_heads"],
        linear_num_value_heads=2 * dims["kv_heads"],
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        layer_types=_every_fourth(dims["layers"], "linear_attention", "full_attention"),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=dims["hidden"],
        shared_expert_intermediate_size=dims["hidden"],
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )
    return Qwen3NextForCausalLM(config).to(torch.bfloat16)


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "tiny")
