"""Hugging Face ``generate()`` continued from the KV a kvfabric store holds
(``fabric.engines.hf``), on real architectures with seeded random weights
(Llama, Qwen2; no checkpoint ships in a package installable here): the tokens
equal ``generate()`` without any cache, turn after turn."""

from __future__ import annotations

import pytest
import torch
import transformers

from fabric.cache.keys import TokenKey
from fabric.config import FabricConfig
from fabric.engines.hf import FabricGenerator
from fabric.engines.store import StoreOptions
from fabric.errors import ConfigError, InvalidInput
from fabric.l3.service import StorageService
from fabric.rank.model import build_model
from fabric.tools.chat import TINY_LLAMA, generate
from tests.interop.support import corrupt_one_payload_byte

pytestmark = pytest.mark.interop

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188]


def config(path, *extra):
    return FabricConfig().with_overrides(
        [*TINY_LLAMA, "cache.page_size=4", "topology.tp=1", f"storage.path={path}", *extra]
    )


@pytest.fixture(scope="module")
def llama():
    return build_model(FabricConfig().with_overrides(TINY_LLAMA).model)


def qwen2():
    cfg = transformers.Qwen2Config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_turns_hit_through_the_answer_with_the_tokens_of_plain_generate(tmp_path, llama, arch):
    model = llama if arch == "llama" else qwen2()
    gen = FabricGenerator(model, config(tmp_path), StoreOptions(path=str(tmp_path)))
    prompt = PROMPT
    for turn in range(3):
        (out,) = gen.generate([prompt], max_new_tokens=6)
        assert out.tokens == generate(model, prompt, 6), f"turn {turn}"
        if turn:
            assert out.hit_tokens >= len(prompt) - 4 - 3, "the last turn's prompt and answer hit"
        else:
            assert out.hit_tokens == 0
        assert out.stored_pages > 0
        prompt = prompt + out.tokens + [7, 8, 9]


def test_a_prompt_cached_whole_leaves_its_last_token_to_generate(tmp_path, llama):
    gen = FabricGenerator(llama, config(tmp_path), StoreOptions(path=str(tmp_path)))
    whole = PROMPT[:16]  # four whole pages
    gen.generate([[*whole, 5, 6, 7, 8]], max_new_tokens=2)
    (out,) = gen.generate([whole], max_new_tokens=5)
    assert out.hit_tokens == 15
    assert out.tokens == generate(llama, whole, 5)


def test_kv_split_over_tp_ranks_is_what_the_fabric_reads(tmp_path, llama):
    cfg = config(tmp_path, "topology.tp=2")
    gen = FabricGenerator(llama, cfg, StoreOptions(path=str(tmp_path)))
    (out,) = gen.generate([PROMPT], max_new_tokens=4)
    service = StorageService(cfg)  # the fabric's own storage actor's logic, both shards
    whole = TokenKey(PROMPT + out.tokens, 4, "default")
    assert service.query(whole.page_hashes()) == (len(PROMPT) + 4 - 1) // 4
    (again,) = gen.generate([PROMPT + out.tokens], max_new_tokens=3)
    assert again.hit_tokens == 20 and again.tokens == generate(llama, PROMPT + out.tokens, 3)


def test_a_corrupt_page_shortens_the_hit_and_the_tokens_stay_right(tmp_path, llama):
    gen = FabricGenerator(llama, config(tmp_path), StoreOptions(path=str(tmp_path)))
    gen.generate([PROMPT], max_new_tokens=4)
    corrupt_one_payload_byte(tmp_path, which=2)
    fresh = FabricGenerator(llama, config(tmp_path), StoreOptions(path=str(tmp_path)))
    (out,) = fresh.generate([PROMPT], max_new_tokens=4)
    assert out.hit_tokens == 8, "pages 0 and 1; page 2 is refused"
    assert out.tokens == generate(llama, PROMPT, 4)
    assert fresh.store.backend.stats()["refused_checksum"] == 1


def test_a_model_in_another_dtype_or_kv_of_another_shape_is_refused_naming_both(tmp_path, llama):
    with pytest.raises(ConfigError, match="computes in float32; .* model.dtype=bfloat16"):
        FabricGenerator(
            llama, config(tmp_path, "model.dtype=bfloat16"), StoreOptions(path=str(tmp_path))
        )
    gen = FabricGenerator(llama, config(tmp_path), StoreOptions(path=str(tmp_path)))
    key = TokenKey(PROMPT, 4, "default")
    wrong = torch.zeros(2, 4, 4, len(PROMPT), 64)  # 4 KV heads; the model has 2
    with pytest.raises(InvalidInput, match=r"KV of shape \(2, 4, 4, 17, 64\) is refused"):
        gen.put(key, wrong, 0)


def test_a_model_of_another_shape_or_an_empty_prompt_is_refused(tmp_path, llama):
    with pytest.raises(ConfigError, match="layers, kv_heads, head_dim"):
        FabricGenerator(llama, config(tmp_path, "model.layers=2"), StoreOptions(path=str(tmp_path)))
    gen = FabricGenerator(llama, config(tmp_path), StoreOptions(path=str(tmp_path)))
    with pytest.raises(InvalidInput, match="empty prompt"):
        gen.generate([[]], max_new_tokens=2)
