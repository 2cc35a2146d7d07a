"""The conversation driver of ``kvfabric run --model``, on the in-process fabric."""

import pytest

from fabric.cli import main
from fabric.driver.local import LocalClient, LocalFabric
from fabric.errors import InvalidInput
from fabric.tools.chat import converse, model_overrides
from tests.helpers import small_config, storage_options


def test_conversations_hit_through_earlier_answers_and_match_uncached_generation():
    config = small_config(
        *[o for o in model_overrides("tiny-llama") if "head_dim" not in o and "layers" not in o],
        "model.layers=2",
        "model.head_dim=16",
        "cache.device_tokens=256",
        "cache.host_tokens=512",
        "cache.session_budget_fraction=0.5",
    )
    f = LocalFabric(config)
    stats = converse(LocalClient(f), config, conversations=2, turns=3, new_tokens=4, check=True)
    assert stats.turns == stats.checked == 6 and stats.mismatches == 0
    assert stats.generated_tokens == 24
    # Turns 2 and 3 hit every whole page of the previous prompt and answer.
    assert stats.tokens.device > 0 and stats.tokens.computed > 0
    assert not f.core.leases and not f.core.cache.sessions.held
    f.core.cache.check_integrity()


@pytest.mark.parametrize(
    "model", ["tiny-gemma3", "tiny-bamba", pytest.param("tiny-qwen3next", marks=pytest.mark.slow)]
)
def test_hybrid_conversations_continue_from_served_state_through_every_tier(model, tmp_path):
    """Tiny L1 and L2 (prompts outgrow them: components are evicted, demoted and
    loaded back), L3 on; a second fabric over the same L3 serves the first turns
    from it. Every answer continued from the served state is the uncached one."""
    config = small_config(
        *model_overrides(model),
        "topology.pp=1",
        "cache.page_size=8",
        "cache.device_tokens=96",
        "cache.host_tokens=96",
        "prefetch.threshold_tokens=8",
        *storage_options(tmp_path),
    )
    tiers = []
    for _ in range(2):
        f = LocalFabric(config)
        stats = converse(LocalClient(f), config, conversations=3, turns=3, new_tokens=3, check=True)
        assert stats.turns == stats.checked == 9 and stats.mismatches == 0
        assert stats.unserved == 0 and stats.max_logits_diff < 1e-4
        f.settle()
        f.core.cache.check_integrity()
        assert not f.core.leases
        tiers.append(stats.tokens)
    assert tiers[0].device > 0 and tiers[0].host > 0, "hits from L1 and L2 loaded back"
    assert tiers[1].storage > 0, "the fresh fabric's first turns come from L3"


@pytest.mark.parametrize(
    "model",
    ["tiny-bamba", "tiny-gemma3", pytest.param("tiny-qwen3next", marks=pytest.mark.slow)],
)
def test_a_rank_holding_the_whole_hybrid_model_computes_from_the_cache(model):
    """At TP = PP = 1 a rank of a Mamba2, gated-delta-net or sliding-window model
    forks each cached state (the mamba slot, the sliding window's pages) and runs
    only the new tokens (decode steps rerun their partial page): the same
    conversations, the same answers, every one as without a cache, and far fewer
    tokens through the model than a rank that runs the whole prefix for every
    value."""
    checkpoints = [] if model == "tiny-gemma3" else ["cache.mamba_checkpoint_tokens=16"]
    config = small_config(
        *model_overrides(model), "topology.tp=1", "topology.pp=1", "cache.page_size=8", *checkpoints
    )
    runs = []
    for from_cache in (True, False):
        f = LocalFabric(config)
        kv = f.ranks[0].filler
        if not from_cache:
            kv.forks = None
        stats = converse(LocalClient(f), config, conversations=2, turns=3, new_tokens=3, check=True)
        assert stats.mismatches == 0 and stats.unserved == 0
        f.core.cache.check_integrity()
        runs.append((kv.run_tokens, stats.tokens.as_dict(), stats.max_logits_diff))
    (cached, tiers, _), (scratch, same_tiers, _) = runs
    assert tiers == same_tiers and tiers["device"] > 0
    assert cached < scratch / 2


def test_bad_model_arguments_are_refused_naming_the_value(capsys):
    assert main(["run", "--model", "no-such-model"]) == 2
    assert "--model 'no-such-model' is refused" in capsys.readouterr().err
    assert main(["run", "--model", "tiny-llama", "--turns", "0"]) == 2
    assert "--turns 0 is refused" in capsys.readouterr().err
    # The check compares with float32 generation: a 16-bit cache is refused
    # before anything launches (and by the library call).
    args = ["run", "--model", "tiny-llama", "--check", "--set", "model.dtype=bfloat16"]
    assert main(args) == 2
    assert "--check is refused with model.dtype=bfloat16" in capsys.readouterr().err
    config = small_config(*model_overrides("tiny-llama"), "model.dtype=float16")
    with pytest.raises(InvalidInput, match="model.dtype=float16"):
        converse(None, config, conversations=1, turns=1, new_tokens=1, check=True)


def test_options_of_the_other_kind_of_run_are_refused_not_ignored(capsys):
    # A model run serves --conversations x --turns turns: --requests would be ignored.
    assert main(["run", "--model", "tiny-llama", "--requests", "24", "--inflight", "2"]) == 2
    err = capsys.readouterr().err
    assert "--requests, --inflight refused with --model" in err and "--turns" in err
    assert main(["run", "--conversations", "2"]) == 2
    assert "--conversations refused without --model" in capsys.readouterr().err


def test_a_model_directory_sets_the_shape_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 3,'
        ' "num_key_value_heads": 2, "vocab_size": 500}'
    )
    overrides = model_overrides(str(tmp_path))
    assert "model.head_dim=64" in overrides and "model.kv_heads=2" in overrides
    assert f"model.path={tmp_path}" in overrides
    with pytest.raises(InvalidInput, match="refused"):
        model_overrides(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"num_attention_heads": 8}')
    with pytest.raises(InvalidInput, match="lacks hidden_size, num_hidden_layers, vocab_size"):
        model_overrides(str(tmp_path))


def test_the_check_attends_to_prompt_tokens_equal_to_the_pad_id():
    """``generate`` masks tokens equal to ``pad_token_id`` (0) unless given a mask:
    the uncached reference must see a prompt with 0s as the model does."""
    import torch

    from fabric.rank.model import build_model, model_kv
    from fabric.tools.chat import generate

    config = small_config(*model_overrides("tiny-llama"), "model.layers=2", "model.head_dim=16")
    hf = build_model(config.model)
    ids = [0, 5, 0, 0, 17, 3, 0, 9]
    want = []
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(6):  # plain greedy decoding, every token attended
            nxt = int(hf(input_ids=x).logits[0, -1].argmax())
            want.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    assert generate(hf, ids, 6) == want
    assert generate(hf, ids, 6, model_kv(hf, ids[:-1])) == want
