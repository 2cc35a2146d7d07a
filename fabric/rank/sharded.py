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
the new pages. Under context parallelism a rank holds the KV of its token
offsets of every page (``ShardPositions``) and computes those positions of the
new tokens only: attention all-gathers the CP group's queries, each rank attends
them over the keys it holds, and the partial results are combined by their
log-sum-exp (``ShardedLlama._attend_cp``) — ring attention's algebra, with
all-gathers for the ring.

Float32 sums in another order than the single-process model: the KV matches a
single-process recomputation within ``ShardedLlamaKV.tolerance``, not bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from fabric.cache.keys import TOKEN_BYTES, unpack_tokens
from fabric.config import ModelConfig, TopologyConfig
from fabric.errors import ConfigError
from fabric.rank.mesh import Mesh, MeshError
from fabric.rank.model import LlamaKV
from fabric.rank.pools import KVPool
from fabric.rank.producer import ShardPositions
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
        self,
        mesh: Mesh | None,
        ids: list[int],
        positions: torch.Tensor,
        prefix_kv: torch.Tensor,
        prefix_positions: torch.Tensor,
        cp_positions: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The KV ``(2, layers, kv_heads, T, head_dim)`` of this rank's share of the
        new tokens ``ids`` at ``positions`` (``T`` of them, ascending), attending to
        ``prefix_kv`` ``(2, layers, kv_heads, P, head_dim)``: this rank's shard of
        the KV before them, at ``prefix_positions``. Hidden states come from the
        previous stage and go to the next one through ``mesh``. With context
        parallelism, ``cp_positions`` lists every CP rank's new positions (this
        rank's among them): attention then combines every CP rank's part."""
        n = len(ids)
        device = prefix_kv.device
        positions = positions.to(device)
        if self.first:
            h = self.embed(torch.tensor(ids, dtype=torch.int64, device=device))
        elif n:
            assert mesh is not None, "a later pipeline stage needs the mesh"
            h = mesh.recv_prev((n, self.hidden), self.dtype)
        else:
            h = torch.empty(0, self.hidden, dtype=self.dtype, device=device)
        cos, sin = self.rotary(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(0), sin[0].unsqueeze(0)  # (1, T, d): over heads
        key_positions = torch.cat((prefix_positions.to(device), positions))
        out = torch.empty(
            2, len(self.layers), self.kv_heads, n, self.head_dim, dtype=h.dtype, device=device
        )
        d = self.head_dim
        # Peers of a TP group or of a pipeline hand-over have the same positions:
        # they skip their collectives together when they have no new token.
        talk = mesh is not None and n > 0
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
            if cp_positions is None:
                attn = self._attend(q, positions, keys, values, key_positions, w.scaling)
            else:
                assert mesh is not None, "context parallelism needs the mesh"
                attn = self._attend_cp(
                    mesh, q, keys, values, key_positions, cp_positions, w.scaling
                )
            attn = attn.transpose(0, 1).reshape(n, self.q_heads * d)
            o = self._linear(attn, w.o, None)
            if talk:
                mesh.all_reduce(o)  # type: ignore[union-attr]
            if "o" in w.bias:
                o = o + w.bias["o"]
            h = h + o
            x = w.norm_post(h)
            gate = self._linear(x, w.gate, w.bias.get("gate"))
            up = self._linear(x, w.up, w.bias.get("up"))
            m = self._linear(w.act(gate) * up, w.down, None)
            if talk:
                mesh.all_reduce(m)  # type: ignore[union-attr]
            if "down" in w.bias:
                m = m + w.bias["down"]
            h = h + m
        if not self.last and n:
            assert mesh is not None, "an earlier pipeline stage needs the mesh"
            mesh.send_next(h)
        return out

    @staticmethod
    def _attend(q, positions, keys, values, key_positions, scaling) -> torch.Tensor:
        """Causal attention of queries at ``positions`` over every key at or before them."""
        later = key_positions.unsqueeze(0) > positions.unsqueeze(1)
        scores = torch.matmul(q, keys.transpose(1, 2)) * scaling
        scores = scores.masked_fill(later, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    @staticmethod
    def _attend_cp(mesh, q, keys, values, key_positions, cp_positions, scaling) -> torch.Tensor:
        """Context-parallel attention: every CP rank holds the keys of its own
        positions only. The CP ranks all-gather their queries; each attends all of
        them over its own keys, giving a partial output and its log-sum-exp per
        query; they all-gather those and each combines the parts of its queries."""
        n = q.shape[1]
        counts = [int(p.numel()) for p in cp_positions]
        width = max(counts)
        me = mesh.cp_rank

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            # Equal shapes on the wire: padded to the longest share of queries.
            padded = t.new_zeros(t.shape[0], width, t.shape[2])
            padded[:, : t.shape[1]] = t
            return [g[:, :c] for g, c in zip(mesh.all_gather_cp(padded), counts, strict=True)]

        queries = torch.cat(gather(q), dim=1)  # (heads, T_all, d), in CP rank order
        query_positions = torch.cat([p.to(q.device) for p in cp_positions])
        later = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
        scores = (torch.matmul(queries, keys.transpose(1, 2)) * scaling).float()
        scores = scores.masked_fill(later, float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(scores - top)
        total = weights.sum(dim=-1, keepdim=True)
        part = torch.matmul(weights, values.float()) / total.clamp_min(1e-30)
        lse = torch.log(total) + top  # -inf where this rank holds no visible key
        parts = torch.stack(mesh.all_gather_cp(part))  # (C, heads, T_all, d)
        lses = torch.stack(mesh.all_gather_cp(lse))  # (C, heads, T_all, 1)
        scale = torch.softmax(lses, dim=0)  # each rank's share of each query's mass
        combined = (parts * scale).sum(dim=0)
        first = sum(counts[:me])
        return combined[:, first : first + n].to(q.dtype)


class ShardedLlamaKV(LlamaKV):
    """A ``KVFiller`` for a rank of a TP x CP x PP split: it computes its share of
    the new tokens only, over the prefix KV in its pool, with its peers (``attach``
    gives it the mesh of the batch being run). Checks recompute with the whole
    model, as ``LlamaKV`` does."""

    # Sharded float32 sums reorder too: the same bound as ``LlamaKV``'s.
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
        self.cp = topology.cp
        # Tokens this rank ran through its layers (new tokens only), in how many passes.
        self.computed_tokens = 0
        self.passes = 0

    def cp_positions(self, start: int, end: int) -> list[torch.Tensor] | None:
        """Under context parallelism, every CP rank's positions in ``[start, end)``
        (this rank's among them, in CP order); else ``None``."""
        if self.cp == 1:
            return None
        return [
            ShardPositions(replace(self.shard, cp_rank=c), self.page_size).positions(start, end)
            for c in range(self.cp)
        ]

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
        # tokens of the first page (this rank's positions of them).
        held_pages = list(prefix_pages or ())[: start_token // self.page_size]
        if keep:
            held_pages.append(pages[0])
        first, end = start_token + keep, start_token + total
        held_positions = self.positions(0, first)
        if held_positions.numel():
            page_idx, offsets = self.locate(held_positions, 0, held_pages)
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
        positions = self.positions(first, end)
        every = unpack_tokens(tokens)
        ids = [every[p - start_token] for p in positions.tolist()]
        kv = self.sharded.forward(
            self.mesh, ids, positions, prefix_kv, held_positions, self.cp_positions(first, end)
        )
        self.computed_tokens += len(ids)
        self.passes += 1
        page_idx, offsets = self.locate(positions, start_token, pages)
        pool.write_tokens(page_idx.to(device), offsets.to(device), kv.permute(0, 3, 1, 2, 4))
