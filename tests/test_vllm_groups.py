"""A vLLM engine's KV cache groups as the connector's components
(``fabric.engines.vllm_groups``): each group's kind, the pages before a hit
point a hit needs of it, its bytes a block, its tag; a group of a kind the
connector cannot serve is refused naming it and what is served."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fabric.engines.vllm_groups import FULL, STATE, WINDOW, group_tag, kv_groups, needs_of
from fabric.errors import ConfigError


class _Dtype:
    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize


@dataclass
class FullAttentionSpec:
    block_size: int = 32
    num_kv_heads: int = 2
    head_size: int = 32
    head_size_v: int = 32
    dtype: _Dtype = field(default_factory=lambda: _Dtype(4))


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 64


@dataclass
class MambaSpec:
    block_size: int = 32
    shapes: tuple = ((3, 512), (4, 64, 64))
    dtypes: tuple = (_Dtype(2), _Dtype(4))
    mamba_cache_mode: str = "align"


@dataclass
class MLAAttentionSpec(FullAttentionSpec):
    use_mla: bool = True


@dataclass
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    attention_chunk_size: int = 128


@dataclass
class Group:
    kv_cache_spec: object
    layer_names: list = field(default_factory=lambda: ["layer"])


@dataclass
class Config:
    kv_cache_groups: list


def test_each_group_is_a_component_and_a_hit_needs_its_window_or_its_state():
    groups = kv_groups(
        Config([Group(SlidingWindowSpec()), Group(MambaSpec()), Group(FullAttentionSpec())])
    )
    assert [g.kind for g in groups] == [WINDOW, STATE, FULL]
    # A window of 64 tokens over blocks of 32: the two pages before a hit point.
    assert [g.before for g in groups] == [2, 1, 0]
    assert groups[1].block_bytes == 3 * 512 * 2 + 4 * 64 * 64 * 4  # the state, no padding
    assert groups[2].block_bytes == 2 * 32 * (32 + 32) * 4
    tag = "0123456789abcdef"
    needs = needs_of(tag, groups)
    assert [before for _, before in needs] == [2, 1]
    assert group_tag(tag, groups[2], groups[2]) == tag  # the chain keeps the engine's tag
    assert len({t for t, _ in needs} | {tag}) == 3  # each group its own keys
    assert all(len(t) == 16 and int(t, 16) >= 0 for t, _ in needs)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (MLAAttentionSpec(), "latent (MLA"),
        (ChunkedLocalAttentionSpec(), "ChunkedLocalAttentionSpec group is not among them"),
        (MambaSpec(mamba_cache_mode="none"), "caches in mode 'none'"),
    ],
)
def test_a_group_the_connector_cannot_serve_is_refused_naming_its_kind(spec, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")) as info:
        kv_groups(Config([Group(FullAttentionSpec()), Group(spec)]))
    assert "KvFabricConnector serves full attention" in str(info.value)


def test_a_model_with_no_full_attention_group_or_mixed_block_sizes_is_refused():
    with pytest.raises(ConfigError, match="needs a full-attention KV cache group"):
        kv_groups(Config([Group(SlidingWindowSpec()), Group(MambaSpec())]))
    with pytest.raises(ConfigError, match=r"block sizes \[32, 64\]"):
        kv_groups(Config([Group(FullAttentionSpec()), Group(SlidingWindowSpec(block_size=64))]))
