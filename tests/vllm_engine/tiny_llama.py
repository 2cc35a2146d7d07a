"""A small random-weight Llama checkpoint vLLM loads (no checkpoint ships in a
package installable here): seeded weights saved with ``save_pretrained``, and a
byte-level BPE tokenizer trained on a few sentences, with a chat template.

Sizes: ``tiny`` for the tests (hidden 256, 2 layers: 4 heads of 64, 2 KV heads,
so TP=2 splits the KV heads); ``bench`` for ``bench/vllm_ttft.py`` (~160M
parameters: hidden 1024, 8 layers, 16 heads, 8 KV heads)."""

from __future__ import annotations

import sys
from pathlib import Path

SIZES = {
    "tiny": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512},
    "bench": {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 8, "vocab": 32000},
}
_WORDS = ["the cache", "of keys", "and values", "kvfabric", "serves", "prefix", "tokens", "again"]


def make(directory: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the checkpoint and tokenizer to ``directory`` (made if missing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SIZES[size]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["hidden"] * 2,
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        head_dim=dims["hidden"] // dims["heads"],
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    save_tokenizer(out, dims["vocab"])
    return out


def save_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of at most ``vocab`` (512) tokens, with a chat
    template, trained on a few sentences and saved to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab, 512),
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [" ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(20)) for i in range(200)]
    tokenizer.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    fast.save_pretrained(out)


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tiny")
