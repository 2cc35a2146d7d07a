"""Multi-turn conversations through a fabric with a real model behind it: the
driver of ``kvfabric run --model``.

Each turn's prompt is the previous prompt, the model's answer and a new message.
The fabric serves the prompt's KV (hits from any tier, the rest computed by the
ranks); the driver reads it back from every rank, continues greedy generation
from it, and has the ranks compute the answer's KV (decode appends), so the next
turn hits through the answer. With ``check``, every turn is also generated
without any cache and the tokens compared. Conversations keep their turns warm
in sessions between turns.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fabric.cache.results import TierTokens
from fabric.config import FabricConfig
from fabric.errors import InvalidInput
from fabric.rank.hybrid import build_hybrid, rebuild, served_states
from fabric.rank.model import assemble, build_model, to_cache, within

# ``--model tiny-llama``: 4 layers, hidden 256, 4 heads, 2 KV heads, vocab 1000,
# seeded random weights (an initializer range of 0.2 keeps greedy output varied).
TINY_LLAMA = [
    "model.filler=llama",
    "model.model_id=tiny-llama",
    "model.dtype=float32",
    "model.layers=4",
    "model.kv_heads=2",
    "model.head_dim=64",
    "model.attention_heads=4",
    "model.vocab_size=1000",
]


# ``--model tiny-gemma3`` / ``tiny-bamba`` / ``tiny-qwen3next``: hybrid models (``model.filler=hybrid``,
# ``fabric.rank.hybrid.build_hybrid``), 4 layers, hidden 64, seeded random
# weights: Gemma 3 with three sliding-window layers (window 7) before a full one,
# Bamba with Mamba2 layers between full ones, Qwen3-Next with gated delta nets
# between full ones (and its mixture of experts).
_TINY_HYBRID = [
    "model.filler=hybrid",
    "model.dtype=float32",
    "model.layers=4",
    "model.kv_heads=2",
    "model.head_dim=16",
    "model.attention_heads=4",
    "model.vocab_size=200",
]
TINY_MODELS = {
    "tiny-llama": TINY_LLAMA,
    "tiny-gemma3": [
        *_TINY_HYBRID,
        "model.model_id=tiny-gemma3",
        "model.layer_kinds=[sliding, sliding, sliding, full]",
        "model.sliding_window=7",
    ],
    "tiny-bamba": [
        *_TINY_HYBRID,
        "model.model_id=tiny-bamba",
        "model.layer_kinds=[mamba, full, mamba, full]",
        "model.mamba_state_bytes=11264",  # a Mamba2 layer's conv and SSM state, float32
    ],
    "tiny-qwen3next": [
        *_TINY_HYBRID,
        "model.model_id=tiny-qwen3next",
        "model.layer_kinds=[mamba, full, mamba, full]",
        "model.recurrent_layer=gated_delta_net",
        "model.mamba_state_bytes=6144",  # a gated delta net's conv and recurrent state
    ],
}


def model_overrides(model: str) -> list[str]:
    """Config overrides for ``--model``: one of ``TINY_MODELS``, or a local Hugging
    Face model directory (its shape read from its ``config.json``)."""
    if model in TINY_MODELS:
        return list(TINY_MODELS[model])
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InvalidInput(
            f"--model {model!r} is refused: allowed is {', '.join(TINY_MODELS)} or a local "
            "model directory with a config.json"
        )
    import json

    cfg = json.loads((path / "config.json").read_text())
    missing = [
        k
        for k in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size")
        if k not in cfg
    ]
    if missing:
        raise InvalidInput(f"--model {model!r}: its config.json lacks {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return [
        "model.filler=llama",
        f"model.path={path}",
        f"model.model_id={path.name}",
        "model.dtype=float32",
        f"model.layers={cfg['num_hidden_layers']}",
        f"model.kv_heads={cfg.get('num_key_value_heads', heads)}",
        f"model.head_dim={head_dim}",
        f"model.attention_heads={heads}",
        f"model.vocab_size={cfg['vocab_size']}",
    ]


# The check: the next token's logits from fabric-served KV against the uncached
# model's, every one within LOGITS_ATOL + LOGITS_RTOL x the largest logit
# (``fabric.rank.model.within``). KV computed in chunks (prefix, then the rest) or
# by sharded ranks sums float32 products in another order than one pass: here
# the logits differ by up to ~2e-5 of the largest.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4


@dataclass
class ChatStats:
    turns: int = 0
    checked: int = 0
    mismatches: int = 0
    tokens: TierTokens = field(default_factory=TierTokens)
    generated_tokens: int = 0
    # The largest difference between the two runs' next-token logits (checked turns).
    max_logits_diff: float = 0.0
    # Hybrid models: turns whose lease lacked a component at its end (no room
    # for it in L1), continued from no cache as an engine would recompute.
    unserved: int = 0
    # Tokens each rank ran through its share of the model, over the whole run.
    computed_tokens_by_rank: dict[str, int] = field(default_factory=dict)


def refuse_check(config: FabricConfig) -> None:
    """``check`` compares with float32 generation without a cache: refused for a
    16-bit cache, whose rounded KV changes a greedy token now and then (5 of 24
    tiny-llama turns on bfloat16, 1 on float16), correct or not. Its KV is checked
    by ``verify()`` within the dtype's precision instead."""
    if config.model.dtype != "float32":
        raise InvalidInput(
            f"--check is refused with model.dtype={config.model.dtype}: it compares with "
            "float32 generation, and KV rounded to 16 bits changes greedy tokens now and "
            "then; set model.dtype=float32, or leave --check out"
        )


def converse(
    fabric: Any,
    config: FabricConfig,
    conversations: int,
    turns: int,
    new_tokens: int,
    check: bool,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> ChatStats:
    """Run ``conversations`` x ``turns`` turns through ``fabric`` (a ``Fabric`` client
    or anything with its methods), ``new_tokens`` generated per turn."""
    if config.model.filler not in ("llama", "hybrid"):
        raise InvalidInput(
            "conversations need model.filler=llama or hybrid (kvfabric run --model ...)"
        )
    if check:
        refuse_check(config)
    hybrid = config.model.filler == "hybrid"
    hf = build_hybrid(config.model) if hybrid else build_model(config.model)
    rng = random.Random(seed)
    vocab = config.model.vocab_size

    def message() -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(8, 24))]

    prompts = [message() for _ in range(conversations)]
    stats = ChatStats()
    for turn in range(turns):
        for c in range(conversations):
            try:
                answer = _turn(
                    fabric,
                    config,
                    hf,
                    prompts[c],
                    new_tokens,
                    stats,
                    check,
                    hybrid,
                    f"chat-{seed}-{c}",
                )
            except InvalidInput as exc:
                raise InvalidInput(f"turn {turn} of conversation {c}: {exc}") from None
            prompts[c] = prompts[c] + answer + message()
            if progress is not None:
                progress(stats.turns)
    for c in range(conversations):
        fabric.end_session(f"chat-{seed}-{c}")
    stats.computed_tokens_by_rank = fabric.computed_tokens_by_rank()
    return stats


def _turn(
    fabric: Any,
    config: FabricConfig,
    hf: Any,
    prompt: list[int],
    new_tokens: int,
    stats: ChatStats,
    check: bool,
    hybrid: bool,
    session: str,
) -> list[int]:
    """One turn: the prompt served, the answer generated from what was served, its
    KV appended; returns the answer."""
    # A hybrid model's state after the last prompt token cannot give that token's
    # logits: its cache is asked for the prompt but its last token.
    asked = prompt[:-1] if hybrid else prompt
    result = fabric.submit(asked)
    if result.error is not None:
        raise InvalidInput(f"failed: {result.error}")
    stats.tokens.add(
        result.device_hit_tokens,
        result.host_hit_tokens,
        result.storage_hit_tokens,
        result.computed_tokens,
    )
    if hybrid:
        answer = _hybrid_turn(fabric, config, hf, prompt, result.lease, new_tokens, stats, check)
    else:
        kv = assemble(
            fabric.read_kv(result.lease), config.model, config.cache.page_size, len(prompt)
        )
        answer = generate(hf, prompt, new_tokens, kv[:, :, :, :-1])
        if check:
            _check(stats, hf, prompt, kv[:, :, :, :-1], answer)
    lease = result.lease
    for token in prompt[len(asked) :] + answer:  # the answer's KV joins the cache
        step = fabric.append(lease, [token])
        if step.error is not None:
            raise InvalidInput(f"decode failed: {step.error}")
        lease = step.lease
    fabric.release(lease, session=session)
    stats.turns += 1
    stats.generated_tokens += len(answer)
    return answer


def _check(
    stats: ChatStats, hf: Any, prompt: list[int], kv: torch.Tensor, answer: list[int]
) -> None:
    """The uncached check of one turn: the answer and the next token's logits from
    the served KV against the model run without a cache."""
    stats.checked += 1
    served, fresh = next_logits(hf, prompt, kv), next_logits(hf, prompt)
    stats.max_logits_diff = max(stats.max_logits_diff, float((served - fresh).abs().max()))
    close = within(served, fresh, LOGITS_ATOL, LOGITS_RTOL)
    stats.mismatches += answer != generate(hf, prompt, len(answer)) or not close


def _hybrid_turn(
    fabric: Any,
    config: FabricConfig,
    hf: tuple[Any, Any],
    prompt: list[int],
    lease: Any,
    new_tokens: int,
    stats: ChatStats,
    check: bool,
) -> list[int]:
    """One turn of a hybrid model: continue greedily from every layer's state the
    fabric served (after the lease's last whole page: full-attention KV, the
    sliding window before it, the mamba states there), the rest of the prompt run
    through the model; with ``check``, also from no cache, and compare."""
    hf_config, model = hf
    page = config.cache.page_size
    end_page = lease.tokens // page
    cache = None
    if end_page:
        try:
            full, parts = fabric.read_kv(lease), fabric.read_parts(lease)
            states = served_states(
                config.model, hf_config, page, end_page, full, parts, list(lease.sliding)
            )
            cache = rebuild(states, hf_config)
        except InvalidInput:
            stats.unserved += 1
            end_page = 0
    cut = end_page * page
    answer, logits = greedy(model, prompt[cut:], cache, cut, new_tokens)
    if check:
        stats.checked += 1
        want, fresh = greedy(model, prompt, None, 0, new_tokens)
        stats.max_logits_diff = max(stats.max_logits_diff, float((logits - fresh).abs().max()))
        close = within(logits, fresh, LOGITS_ATOL, LOGITS_RTOL)
        stats.mismatches += answer != want or not close
    return answer


def greedy(
    model: Any, ids: list[int], cache: Any, start: int, n: int
) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens after ``ids`` fed at position ``start`` onto ``cache`` (a
    rebuilt hybrid cache, or ``None``), and the first one's logits. Positions are
    explicit: a rebuilt Mamba cache needs them."""
    out, pos, first = [], start, None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            positions = torch.arange(pos, pos + x.shape[1]).unsqueeze(0)
            o = model(x, cache=cache, use_cache=True, position_ids=positions)
            pos += x.shape[1]
            cache = o.past_key_values
            logits = o.logits[0, -1]
            first = logits if first is None else first
            out.append(int(logits.argmax()))
            x = torch.tensor([[out[-1]]])
    assert first is not None
    return out, first


def next_logits(hf: Any, ids: list[int], kv: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of the token after ``ids``: from scratch, or from ``kv``, the KV
    of all of ``ids`` but the last token."""
    with torch.no_grad():
        if kv is None:
            return hf(input_ids=torch.tensor([ids])).logits[0, -1]
        last = torch.tensor([ids[-1:]])
        return hf(input_ids=last, cache=to_cache(kv, hf)).logits[0, -1]


def generate(hf: Any, ids: list[int], new_tokens: int, kv: torch.Tensor | None = None) -> list[int]:
    """Greedy tokens after ``ids``: from scratch, or continued from ``kv``, the KV
    of all of ``ids`` but the last token. Every prompt token is attended to: the
    mask is given, since ``generate`` would otherwise mask each token equal to the
    pad id."""
    x = torch.tensor([ids])
    cache = None if kv is None else to_cache(kv, hf)
    with torch.no_grad():
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()
