"""The model-parallel shape: which ranks there are and what each holds of a page.
Shared by the coordinator, the ranks' data plane and the storage service."""

from __future__ import annotations

from dataclasses import dataclass

from fabric.config import ModelConfig, TopologyConfig


@dataclass(frozen=True)
class RankId:
    pp: int
    cp: int
    tp: int

    def __str__(self) -> str:
        return f"pp{self.pp}-cp{self.cp}-tp{self.tp}"

    @property
    def suffix(self) -> str:
        """The shard suffix of this rank's L3 page keys: ``pp-cp-tp``."""
        return f"{self.pp}-{self.cp}-{self.tp}"


@dataclass(frozen=True)
class Shard:
    """What one rank holds of every page: layers ``[layer_start, layer_start +
    layers)``, KV heads ``[head_start, head_start + heads)``, and token offsets
    ``[cp_rank * page_tokens, (cp_rank + 1) * page_tokens)`` of each page."""

    rank: RankId
    layer_start: int
    layers: int
    head_start: int
    heads: int
    cp_rank: int
    page_tokens: int


class Topology:
    """The ranks of a TP x CP x PP layout, in a fixed order (index = position)."""

    def __init__(self, config: TopologyConfig) -> None:
        self.config = config
        self.ranks = [
            RankId(pp, cp, tp)
            for pp in range(config.pp)
            for cp in range(config.cp)
            for tp in range(config.tp)
        ]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def stage(self, pp: int) -> list[RankId]:
        return [r for r in self.ranks if r.pp == pp]

    def shard(self, index: int, model: ModelConfig, page_size: int) -> Shard:
        rank = self.ranks[index]
        c = self.config
        layers, heads = model.layers // c.pp, model.kv_heads // c.tp
        return Shard(
            rank, rank.pp * layers, layers, rank.tp * heads, heads, rank.cp, page_size // c.cp
        )


def kind_layers(shard: Shard, model: ModelConfig, kind: str) -> list[int]:
    """The global indices of ``shard``'s layers of ``kind`` (``full``, ``sliding``
    or ``mamba``; every layer is ``full`` in a full-attention model)."""
    kinds = model.kinds
    return [
        i for i in range(shard.layer_start, shard.layer_start + shard.layers) if kinds[i] == kind
    ]
