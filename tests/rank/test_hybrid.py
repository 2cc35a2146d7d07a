"""Hybrid models' per-layer state out of a transformers cache and back: tiny
seeded-random Gemma3 (sliding + full attention) and Bamba (Mamba2 + attention)
on the pure-torch CPU paths continue from a rebuilt cache exactly as from none."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fabric.errors import InvalidInput  # noqa: E402
from fabric.rank.hybrid import (  # noqa: E402
    FullKV,
    MambaState,
    SlidingKV,
    component_bytes,
    extract,
    layer_kinds,
    rebuild,
)
from fabric.tools.chat import greedy as chat_greedy  # noqa: E402

WINDOW = 8


def gemma3():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,  # else greedy output degenerates at this size
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return cfg, transformers.Gemma3ForCausalLM(cfg).eval()


def bamba():
    cfg = transformers.BambaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return cfg, transformers.BambaForCausalLM(cfg).eval()


def greedy(model, ids, cache, n, start):
    """``n`` greedy tokens after ``ids`` (a ``(1, T)`` tensor) fed at position
    ``start`` (explicit position ids: Bamba needs them with a rebuilt cache)."""
    return chat_greedy(model, ids[0].tolist(), cache, start, n)[0]


def prefix_states(model, cfg, prompt, n):
    with torch.no_grad():
        o = model(prompt[:, :n], use_cache=True, position_ids=torch.arange(n).unsqueeze(0))
    return o.past_key_values, extract(o.past_key_values, layer_kinds(cfg))


@pytest.mark.parametrize("make", [gemma3, bamba], ids=["gemma3-swa", "bamba-mamba2"])
def test_a_rebuilt_cache_continues_exactly_as_no_cache(make):
    cfg, model = make()
    prompt = torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    expected = greedy(model, prompt, None, 10, 0)
    for cut in (5, 24):  # a prefix shorter and one longer than the window
        _, states = prefix_states(model, cfg, prompt, cut)
        got = greedy(model, prompt[:, cut:], rebuild(states, cfg), 10, cut)
        assert got == expected, f"continuing after {cut} cached tokens"


def test_sliding_layers_keep_the_window_and_record_the_prefix_length():
    cfg, model = gemma3()
    prompt = torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(2))
    _, states = prefix_states(model, cfg, prompt, 24)
    assert [type(s) for s in states] == [SlidingKV, SlidingKV, SlidingKV, FullKV]
    assert states[0].keys.shape[2] == WINDOW - 1 and states[0].length == 24
    assert states[3].keys.shape[2] == 24
    sizes = component_bytes(states)
    assert sizes["sliding"] == 3 * sizes["full"] * (WINDOW - 1) // 24
    assert sizes["mamba"] == 0


def test_extracted_state_is_a_copy_the_running_cache_does_not_change():
    cfg, model = bamba()
    prompt = torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(3))
    cache, states = prefix_states(model, cfg, prompt, 20)
    assert [type(s) for s in states] == [MambaState, FullKV, MambaState, FullKV]
    before = [s.recurrent.clone() for s in states if isinstance(s, MambaState)]
    with torch.no_grad():  # the cache runs on, updating its states in place
        model(prompt[:, 20:], cache=cache, use_cache=True,
              position_ids=torch.arange(20, 30).unsqueeze(0))  # fmt: skip
    after = [s.recurrent for s in states if isinstance(s, MambaState)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert component_bytes(states)["mamba"] > 0


def test_unknown_layer_types_and_mismatched_states_are_refused():
    cfg, _ = gemma3()
    cfg.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "x"]
    with pytest.raises(InvalidInput, match="'chunked_attention', 'x' are not supported"):
        layer_kinds(cfg)
    cfg, model = gemma3()
    _, states = prefix_states(model, cfg, torch.zeros(1, 10, dtype=torch.long), 10)
    with pytest.raises(InvalidInput, match="3 layer states for a model of 4 layers"):
        rebuild(states[:3], cfg)


def test_a_mamba_state_splits_over_tp_ranks_by_heads_and_groups_and_back():
    from fabric.config import ModelConfig
    from fabric.errors import ConfigError
    from fabric.rank.hybrid import build_hybrid, check_mamba_tp, mamba_from_shares, mamba_share

    cfg, model = build_hybrid(
        ModelConfig(layers=2, layer_kinds=("mamba", "full"), kv_heads=2, head_dim=16)
    )
    with torch.no_grad():
        out = model(
            torch.tensor([[5, 6, 7, 8]]), use_cache=True, position_ids=torch.arange(4)[None]
        )
    state = extract(out.past_key_values, ["mamba", "full"])[0]
    inner, ds, k = cfg.mamba_n_heads * cfg.mamba_d_head, cfg.mamba_d_state, state.kernel
    groups = cfg.mamba_n_groups
    shares = [mamba_share(cfg, state, r, 2) for r in range(2)]
    # Rank 1 holds the second half of the x channels, group 1 of B and of C, and
    # the second half of the heads' recurrent states — not the flat state's halves.
    conv = state.conv[0]
    want = torch.cat(
        [
            conv[inner // 2 : inner].flatten(),
            conv[inner + ds : inner + 2 * ds].flatten(),
            conv[inner + groups * ds + ds : inner + 2 * groups * ds].flatten(),
            state.recurrent[0, cfg.mamba_n_heads // 2 :].flatten(),
        ]
    )
    assert torch.equal(shares[1], want)
    assert sum(s.numel() for s in shares) == conv.numel() + state.recurrent.numel()
    back = mamba_from_shares(cfg, shares, k)
    assert torch.equal(back.conv, state.conv) and torch.equal(back.recurrent, state.recurrent)
    with pytest.raises(ConfigError, match="topology.tp=4"):
        check_mamba_tp(cfg, 4)  # two groups do not split over four ranks


def test_a_gated_delta_net_state_splits_over_tp_ranks_by_key_and_value_heads():
    from fabric.config import ModelConfig
    from fabric.errors import ConfigError
    from fabric.rank.hybrid import build_hybrid, check_mamba_tp, mamba_from_shares, mamba_share

    model_cfg = ModelConfig(
        layers=2,
        layer_kinds=("mamba", "full"),
        kv_heads=2,
        head_dim=16,
        recurrent_layer="gated_delta_net",
    )
    cfg, model = build_hybrid(model_cfg)
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    with torch.no_grad():
        out = model(
            torch.tensor([[5, 6, 7, 8]]), use_cache=True, position_ids=torch.arange(4)[None]
        )
    state = extract(out.past_key_values, ["mamba", "full"])[0]
    kd = cfg.linear_key_head_dim * cfg.linear_num_key_heads  # q's and k's channels
    vd = cfg.linear_value_head_dim * cfg.linear_num_value_heads
    shares = [mamba_share(cfg, state, r, 2) for r in range(2)]
    conv = state.conv[0]
    # Rank 1: key head 1's q and k channels, value heads 2 and 3's v channels and
    # recurrent states.
    want = torch.cat(
        [
            conv[kd // 2 : kd].flatten(),
            conv[kd + kd // 2 : 2 * kd].flatten(),
            conv[2 * kd + vd // 2 :].flatten(),
            state.recurrent[0, cfg.linear_num_value_heads // 2 :].flatten(),
        ]
    )
    assert torch.equal(shares[1], want)
    back = mamba_from_shares(cfg, shares, state.kernel)
    assert torch.equal(back.conv, state.conv) and torch.equal(back.recurrent, state.recurrent)
    with pytest.raises(ConfigError, match="topology.tp=4 is refused .* 2 key heads"):
        check_mamba_tp(cfg, 4)
