"""``ShardedLlama`` alone: every rank's share of a Llama model, each on a thread
with gloo groups between them, computes the KV of new tokens over a cached
prefix as the whole model computes it, for TP, PP, CP and their products, with
biases on every projection and an intermediate size the TP split does not
divide."""

from __future__ import annotations

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fabric.config import ModelConfig, TopologyConfig  # noqa: E402
from fabric.rank.mesh import LocalBoard, Mesh  # noqa: E402
from fabric.rank.model import model_kv, within  # noqa: E402
from fabric.rank.producer import ShardPositions  # noqa: E402
from fabric.rank.sharded import ShardedLlama  # noqa: E402
from fabric.topology import Topology  # noqa: E402

PAGE = 4


def biased_model():
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=90,  # not a multiple of 4: uneven MLP shares
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        attention_bias=True,
        mlp_bias=True,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    return hf


def run_split(hf, tp: int, pp: int, cp: int, ids: list[int], start: int) -> dict:
    """Each rank's KV of ``ids[start:]`` against the whole model's, by rank index."""
    topology = TopologyConfig(tp=tp, pp=pp, cp=cp)
    model = ModelConfig(layers=4, kv_heads=4, head_dim=8)
    topo = Topology(topology)
    full = model_kv(hf, ids)  # (2, layers, heads, T, d)
    board, out, errors = LocalBoard(), {}, []

    def run(i: int) -> None:
        try:
            shard = topo.shard(i, model, PAGE)
            m = ShardedLlama(hf, shard, topology, torch.device("cpu"))
            mesh = (
                Mesh(board, "t", topology, i, torch.device("cpu"), 20)
                if topo.world_size > 1
                else None
            )
            positions = ShardPositions(shard, PAGE)
            held, new = positions.positions(0, start), positions.positions(start, len(ids))
            every = None
            if cp > 1:
                peers = [topo.shard(j, model, PAGE) for j in range(topo.world_size)]
                every = [
                    ShardPositions(s, PAGE).positions(start, len(ids))
                    for s in peers
                    if (s.rank.pp, s.rank.tp) == (shard.rank.pp, shard.rank.tp)
                ]
            layers = slice(shard.layer_start, shard.layer_start + shard.layers)
            heads = slice(shard.head_start, shard.head_start + shard.heads)
            mine = full[:, layers, heads]
            got = m.forward(
                mesh, [ids[p] for p in new.tolist()], new, mine[:, :, :, held], held, every
            )
            out[i] = (got, mine[:, :, :, new])
        except Exception as exc:  # a thread's failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(topo.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


@pytest.mark.parametrize(
    "tp,pp,cp", [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2)]
)
@pytest.mark.parametrize("start", [0, 8, 13])
def test_every_split_computes_the_new_tokens_kv_as_the_whole_model(tp, pp, cp, start):
    hf = biased_model()
    ids = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(start)).tolist()
    out = run_split(hf, tp, pp, cp, ids, start)
    assert len(out) == tp * pp * cp
    for got, want in out.values():
        assert got.shape == want.shape
        assert within(got, want, 1e-4, 1e-4), float((got - want).abs().max())


def test_a_wrong_prefix_gives_other_kv():
    """The check above can fail: the new tokens' KV depends on the prefix KV read."""
    hf = biased_model()
    ids = list(range(20))
    full = model_kv(hf, ids)
    topology = TopologyConfig(tp=1, pp=1, cp=1)
    shard = Topology(topology).shard(0, ModelConfig(layers=4, kv_heads=4, head_dim=8), PAGE)
    m = ShardedLlama(hf, shard, topology, torch.device("cpu"))
    held, new = torch.arange(12), torch.arange(12, 20)
    good = m.forward(None, ids[12:], new, full[:, :, :, held], held)
    # Another sequence's prefix KV (attention ignores the keys' order, not their values).
    other = model_kv(hf, [t + 1 for t in ids])
    bad = m.forward(None, ids[12:], new, other[:, :, :, held], held)
    assert within(good, full[:, :, :, new], 1e-4, 1e-4)
    assert not within(bad, full[:, :, :, new], 1e-4, 1e-4)
