"""The identity of an engine's pages, from vLLM's own configuration objects: two
engines that differ in anything that changes a block's bytes — the weights (a
model replaced in place), revision, load format, quantization, model and exact
KV cache dtypes, RoPE scaling and other overrides, the TP/PP split, the
attention backend and tensor layout in use, a LoRA adapter's weights — never
get the same identity, and so never share a page; a copy of the same checkpoint
at another path does."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from fabric.engines.vllm_identity import (
    checkpoint_of,
    engine_identity,
    lora_identity,
    page_provenance,
    rank_identity,
)
from fabric.errors import ConfigError
from tests.vllm_engine import tiny_llama

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("identity")
    tiny_llama.make(base / "model")
    shutil.copytree(base / "model", base / "copy")
    return base


def config(model, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    args = {"dtype": "float32", "block_size": 32, "max_model_len": 2048, "enforce_eager": True}
    return EngineArgs(model=str(model), **{**args, **engine_args}).create_engine_config()


def identity(cfg) -> str:
    return json.dumps(engine_identity(cfg, checkpoint_of(cfg)), sort_keys=True, default=str)


@pytest.fixture(scope="module")
def base(models):
    return identity(config(models / "model"))


def test_a_copy_of_the_checkpoint_at_another_path_is_the_same_engine(models, base):
    assert identity(config(models / "copy")) == base


@pytest.mark.parametrize(
    "engine_args",
    [
        {"revision": "v2"},
        {"load_format": "dummy"},
        {"dtype": "bfloat16"},
        {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}},
        {"hf_overrides": {"rms_norm_eps": 1e-5}},
    ],
    ids=["revision", "load_format", "dtype", "rope_scaling", "override"],
)
def test_engines_differing_in_one_setting_have_other_identities(models, base, engine_args):
    assert identity(config(models / "model", **engine_args)) != base


def test_weights_replaced_in_place_are_another_identity(models, base, tmp_path):
    swapped = tmp_path / "swapped"
    shutil.copytree(models / "model", swapped)
    cfg = config(swapped)
    assert identity(cfg) == base
    tiny_llama.make(swapped, seed=1)  # same path, same shapes, other weights
    assert identity(cfg) != base


@pytest.mark.parametrize(
    ("where", "field", "values"),
    [
        ("model_config", "quantization", (None, "awq")),
        ("cache_config", "cache_dtype", ("fp8_e4m3", "fp8_e5m2")),
        ("cache_config", "cache_dtype", ("auto", "float16")),
        ("parallel_config", "tensor_parallel_size", (1, 2)),
        ("parallel_config", "pipeline_parallel_size", (1, 2)),
    ],
)
def test_each_field_that_makes_the_bytes_is_in_the_identity(models, where, field, values):
    cfg = config(models / "model")
    seen = set()
    for value in values:
        setattr(getattr(cfg, where), field, value)
        seen.add(identity(cfg))
    assert len(seen) == len(values)


def test_a_kv_cache_dtype_whose_scales_live_beside_the_blocks_is_refused(models):
    cfg = config(models / "model")
    cfg.cache_config.cache_dtype = "int8_per_token_head"
    with pytest.raises(ConfigError, match="int8_per_token_head"):
        engine_identity(cfg, "x")


def test_the_backend_and_the_layout_in_use_are_in_a_ranks_identity():
    spec = SimpleNamespace(block_size=32, num_kv_heads=2, head_size=64, head_size_v=64,
                           dtype=torch.float32, kv_quant_mode="none")  # fmt: skip
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])
    kv_config = SimpleNamespace(kv_cache_groups=[group], num_blocks=8)
    engine = {"checkpoint": "c"}
    kv = {n: torch.zeros(8, 2, 32, 128) for n in ("l0", "l1")}
    base = rank_identity(engine, kv_config, kv, {"l0": "CPU_ATTN", "l1": "CPU_ATTN"})
    assert rank_identity(engine, kv_config, kv, {"l0": "CPU_ATTN", "l1": "CPU_ATTN"}) == base
    assert rank_identity(engine, kv_config, kv, {"l0": "SDPA", "l1": "CPU_ATTN"}) != base
    other = {n: torch.zeros(2, 8, 32, 128).transpose(0, 1) for n in ("l0", "l1")}  # strides
    assert rank_identity(engine, kv_config, other, {"l0": "CPU_ATTN", "l1": "CPU_ATTN"}) != base
    bigger = SimpleNamespace(kv_cache_groups=[group], num_blocks=16)  # another pool size
    kv16 = {n: torch.zeros(16, 2, 32, 128) for n in ("l0", "l1")}
    assert rank_identity(engine, bigger, kv16, {"l0": "CPU_ATTN", "l1": "CPU_ATTN"}) == base
    stage = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                             layer_names=["l2", "l3"])],
                            num_blocks=8)  # fmt: skip
    assert rank_identity(engine, stage, {"l2": kv["l0"], "l3": kv["l1"]}, {}) != base
    assert rank_identity({"checkpoint": "d"}, kv_config, kv, {"l0": "CPU_ATTN"}) != base
    provenance = page_provenance(kv_config, base)
    assert base[:32] in provenance.layout and provenance.shard_shape == (2, 2, 32, 64)


def test_a_lora_adapter_is_its_weights(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"one")
    request = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(adapter))
    first = lora_identity(request)
    renamed = SimpleNamespace(lora_name="b", lora_int_id=2, lora_path=str(adapter))
    assert lora_identity(renamed) == first  # the name is not the adapter
    (adapter / "adapter_model.safetensors").write_bytes(b"two")
    assert lora_identity(request) != first
    gone = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "none"))
    assert lora_identity(gone) is None  # unreadable: not served by the fabric
