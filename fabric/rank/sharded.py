"""A Llama model split over the ranks as a tensor- and pipeline-parallel engine
splits it, computing new tokens only, from the prefix KV in a rank's pool.

Each rank keeps its pipeline stage's layers and, of each layer, its tensor-
parallel share: the query heads that read its KV heads and their KV projections
(column-parallel), the matching input columns of the output projection (row-
parallel), and a slice of the MLP's intermediate size (gate and up column-
parallel, down row-parallel). The row-parallel products are partial sums that
the stage's ranks all-reduce, once after attention and once after the MLP of
every layer; the first stage embeds the tokens, and each stage hands its hidden
states of the new tokens to the same rank of the next (``Mesh.send_next``).

Attention runs over the prefix's KV, read from the rank's L1 pages, and the new
tokens' own; the new KV (post-rotary keys, as Hugging Face caches them) goes into
the new pages. Context parallelism is not computed this way (the ranks of a CP
split recompute, see ``LlamaKV``).

Float32 sums in another order than the single-process model: the KV matches a
single-process recomputation within ``ShardedLlamaKV.tolerance``, not bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from fabric.cache.keys import TOKEN_BYTES, unpack_tokens
from fabric.config import ModelConfig, TopologyConfig
from fabric.errors import ConfigError
from fabric.rank.mesh import Mesh, MeshError
from fabric.rank.model import LlamaKV
from fabric.rank.pools import KVPool
from fabric.topology import Shard


@dataclass
class _Layer:
    """One decoder layer's tensor-parallel share of the weights."""

    norm_in: Any
    norm_post: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    bias: dict[str, torch.Tensor]
    act: Any
    scaling: float


def _split(total: int, parts: int, part: int) -> slice:
    """Part ``part`` of ``range(total)`` cut in ``parts`` nearly equal pieces."""
    base, extra = divmod(total, parts)
    start = part * base + min(part, extra)
    return slice(start, start + base + (part < extra))


class ShardedLlama:
    """This rank's share of ``hf`` (a ``LlamaForCausalLM``): see the module docstring."""

    def __init__(
        self, hf: Any, shard: Shard, topology: TopologyConfig, device: torch.device
    ) -> None:
        cfg = hf.config
        tp = topology.tp
        if cfg.num_key_value_heads % tp:
            raise ConfigError(
                f"topology.tp={tp} does not divide the model's {cfg.num_key_value_heads} KV heads"
            )
        self.shard = shard
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads  # queries per KV head
        self.kv_heads = shard.heads
        self.q_heads = shard.heads * self.group
        self.first = shard.layer_start == 0
        self.last = shard.layer_start + shard.layers == cfg.num_hidden_layers
        base = hf.model

        def own(module: Any) -> Any:  # a copy on this rank's device (``hf`` stays)
            return copy.deepcopy(module).to(device)

        def part(w: torch.Tensor) -> torch.Tensor:
            return w.detach().to(device).contiguous()

        self.embed = own(base.embed_tokens) if self.first else None
        self.rotary = own(base.rotary_emb)
        self.hidden = cfg.hidden_size
        d = self.head_dim
        kv = slice(shard.head_start * d, (shard.head_start + shard.heads) * d)
        q = slice(kv.start * self.group, kv.stop * self.group)
        self.layers: list[_Layer] = []
        for i in range(shard.layer_start, shard.layer_start + shard.layers):
            layer = base.layers[i]
            at, mlp = layer.self_attn, layer.mlp
            inter = _split(mlp.gate_proj.weight.shape[0], tp, shard.rank.tp)
            bias: dict[str, torch.Tensor] = {}
            for name, linear, rows in (
                ("q", at.q_proj, q),
                ("k", at.k_proj, kv),
                ("v", at.v_proj, kv),
                ("gate", mlp.gate_proj, inter),
                ("up", mlp.up_proj, inter),
            ):
                if linear.bias is not None:
                    bias[name] = part(linear.bias[rows])
            # Row-parallel biases are added once, after the all-reduce.
            for name, linear in (("o", at.o_proj), ("down", mlp.down_proj)):
                if linear.bias is not None:
                    bias[name] = part(linear.bias)
            self.layers.append(
                _Layer(
                    own(layer.input_layernorm),
                    own(layer.post_attention_layernorm),
                    part(at.q_proj.weight[q]),
                    part(at.k_proj.weight[kv]),
                    part(at.v_proj.weight[kv]),
                    part(at.o_proj.weight[:, q]),
                    part(mlp.gate_proj.weight[inter]),
                    part(mlp.up_proj.weight[inter]),
                    part(mlp.down_proj.weight[:, inter]),
                    bias,
                    own(mlp.act_fn),
                    at.scaling,
                )
            )
        self.dtype = hf.dtype

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + turned * sin

    @torch.no_grad()
    def forward(
        self, mesh: Mesh | None, ids: list[int], start: int, prefix_kv: torch.Tensor
    ) -> torch.Tensor:
        """The KV ``(2, layers, kv_heads, T, head_dim)`` of this rank's share of the
        ``T`` new tokens ``ids`` at positions ``[start, start + T)``, attending to
        ``prefix_kv`` ``(2, layers, kv_heads, start, head_dim)`` (this rank's shard
        of the KV before them). Hidden states come from the previous stage and go
        to the next one through ``mesh``."""
        n = len(ids)
        device = prefix_kv.device
        if self.first:
            h = self.embed(torch.tensor(ids, dtype=torch.int64, device=device))
        else:
            assert mesh is not None, "a later pipeline stage needs the mesh"
            h = mesh.recv_prev((n, self.hidden), self.dtype)
        positions = torch.arange(start, start + n, device=device).unsqueeze(0)
        cos, sin = self.rotary(h.unsqueeze(0), positions)
        cos, sin = cos[0].unsqueeze(0), sin[0].unsqueeze(0)  # (1, T, d): over heads
        # A new token attends to the whole prefix and to the new tokens up to itself.
        causal = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
        mask = torch.zeros(n, start + n, dtype=h.dtype, device=device)
        mask[:, start:].masked_fill_(causal, float("-inf"))
        out = torch.empty(
            2, len(self.layers), self.kv_heads, n, self.head_dim, dtype=h.dtype, device=device
        )
        d = self.head_dim
        for i, w in enumerate(self.layers):
            x = w.norm_in(h)
            q = self._linear(x, w.q, w.bias.get("q")).view(n, self.q_heads, d).transpose(0, 1)
            k = self._linear(x, w.k, w.bias.get("k")).view(n, self.kv_heads, d).transpose(0, 1)
            v = self._linear(x, w.v, w.bias.get("v")).view(n, self.kv_heads, d).transpose(0, 1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            out[0, i], out[1, i] = k, v
            keys = torch.cat((prefix_kv[0, i].to(k.dtype), k), dim=1)
            values = torch.cat((prefix_kv[1, i].to(v.dtype), v), dim=1)
            keys = keys.repeat_interleave(self.group, dim=0)
            values = values.repeat_interleave(self.group, dim=0)
            scores = torch.matmul(q, keys.transpose(1, 2)) * w.scaling + mask
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attn = torch.matmul(probs, values).transpose(0, 1).reshape(n, self.q_heads * d)
            o = self._linear(attn, w.o, None)
            if mesh is not None:
                mesh.all_reduce(o)
            if "o" in w.bias:
                o = o + w.bias["o"]
            h = h + o
            x = w.norm_post(h)
            gate = self._linear(x, w.gate, w.bias.get("gate"))
            up = self._linear(x, w.up, w.bias.get("up"))
            m = self._linear(w.act(gate) * up, w.down, None)
            if mesh is not None:
                mesh.all_reduce(m)
            if "down" in w.bias:
                m = m + w.bias["down"]
            h = h + m
        if not self.last:
            assert mesh is not None, "an earlier pipeline stage needs the mesh"
            mesh.send_next(h)
        return out


class ShardedLlamaKV(LlamaKV):
    """A ``KVFiller`` for a rank of a TP x PP split (no CP): it computes its share
    of the new tokens only, over the prefix KV in its pool, with its stage's and
    tensor-parallel group's ranks (``attach`` gives it the mesh of the batch
    being run). Checks recompute with the whole model, as ``LlamaKV`` does."""

    # Sharded float32 sums reorder: KV within this of a single-process recompute,
    # absolute plus relative to the value (KV values reach tens).
    tolerance = 1e-4
    rtol = 1e-4
    needs_mesh = True

    def __init__(
        self,
        shard: Shard,
        model: ModelConfig,
        page_size: int,
        topology: TopologyConfig,
        device: torch.device,
    ) -> None:
        super().__init__(shard, model, page_size)
        self.sharded = ShardedLlama(self.model, shard, topology, device)
        self.mesh: Mesh | None = None
        self.world = topology.tp * topology.pp * topology.cp
        # Tokens this rank ran through its layers (new tokens only).
        self.computed_tokens = 0

    def attach(self, mesh: Mesh | None) -> None:
        self.mesh = mesh

    def fill(
        self,
        pool: KVPool,
        namespace: str,
        prev_hash: bytes,
        tokens: bytes,
        start_token: int,
        pages: list[int],
        prefix: bytes = b"",
        prefix_pages: list[int] | None = None,
        keep: int = 0,
    ) -> None:
        total = len(tokens) // TOKEN_BYTES
        if not total or keep == total:
            return
        if not 0 <= keep < min(total, self.page_size) or (keep and not pages):
            raise ValueError(f"keep={keep} is refused for a compute of {total} tokens")
        if self.world > 1 and self.mesh is None:
            raise MeshError("a sharded compute without a mesh")
        if start_token and len(prefix_pages or ()) * self.page_size < start_token:
            raise ValueError(
                f"a compute from token {start_token} needs the prefix's pages, got "
                f"{len(prefix_pages or ())}"
            )
        device = pool.buffer.device
        # The KV before the new tokens: the prefix's pages, and the first ``keep``
        # tokens of the first page.
        held_pages = list(prefix_pages or ())[: start_token // self.page_size]
        if keep:
            held_pages.append(pages[0])
        first = start_token + keep
        if first:
            positions = self.positions(0, first)
            page_idx, offsets = self.locate(positions, 0, held_pages)
            held = pool.read_tokens(page_idx.to(device), offsets.to(device))
            prefix_kv = held.permute(0, 2, 3, 1, 4).to(self.sharded.dtype)
        else:
            s = self.shard
            prefix_kv = torch.empty(
                2,
                s.layers,
                s.heads,
                0,
                self.sharded.head_dim,
                dtype=self.sharded.dtype,
                device=device,
            )
        ids = unpack_tokens(tokens)[keep:]
        kv = self.sharded.forward(self.mesh, ids, first, prefix_kv)
        self.computed_tokens += len(ids)
        end = start_token + total
        page_idx, offsets = self.locate(self.positions(first, end), start_token, pages)
        pool.write_tokens(page_idx.to(device), offsets.to(device), kv.permute(0, 3, 1, 2, 4))
