"""How a recurrent layer's state (the ``mamba`` component) is laid out and split
over TP ranks, for the two families a hybrid model may have:

- Mamba2 (Bamba): a conv state over the channels ``[x | B | C]`` of the layer's
  in-projection — ``x`` by heads, ``B`` and ``C`` by groups — and a recurrent
  state ``(heads, head_dim, d_state)``;
- a gated delta net (Qwen3-Next's linear attention): a conv state over
  ``[q | k | v]`` — ``q`` and ``k`` by key heads, ``v`` by value heads — and a
  recurrent state ``(value heads, key_dim, value_dim)``.

A TP rank of an engine holds its heads' (and groups') channels of the conv state
and its heads' recurrent state: ``share`` is that, flat; ``from_shares`` puts
every rank's share back together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fabric.errors import ConfigError


@dataclass(frozen=True)
class StateLayout:
    # Conv channel segments in order, each split evenly over TP ranks:
    # (what it is split by, its channels).
    segments: tuple[tuple[str, int], ...]
    # The recurrent state's per-head shape and its head count (split over TP).
    heads: int
    head_shape: tuple[int, int]
    kernel: int
    # Each split unit's count (heads, groups), which TP must divide.
    units: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, c: Any) -> StateLayout:
        """The layout of ``c``'s recurrent layers (a ``BambaConfig`` or a
        ``Qwen3NextConfig``)."""
        if hasattr(c, "linear_num_value_heads"):  # a gated delta net
            kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
            kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
            return cls(
                (("key heads", kh * kd), ("key heads", kh * kd), ("value heads", vh * vd)),
                vh,
                (kd, vd),
                c.linear_conv_kernel_dim,
                (("key heads", kh), ("value heads", vh)),
            )
        inner, groups, ds = c.mamba_n_heads * c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state
        return cls(
            (("heads", inner), ("groups", groups * ds), ("groups", groups * ds)),
            c.mamba_n_heads,
            (c.mamba_d_head, ds),
            c.mamba_d_conv,
            (("heads", c.mamba_n_heads), ("groups", groups)),
        )

    @property
    def channels(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def floats(self) -> int:
        """Values of one layer's whole state (conv + recurrent)."""
        a, b = self.head_shape
        return self.channels * self.kernel + self.heads * a * b

    def check_tp(self, tp: int) -> None:
        """The layer splits over ``tp`` ranks only by whole heads and groups."""
        for name, count in self.units:
            if count % tp:
                counts = " and ".join(f"{n} {what}" for what, n in self.units)
                raise ConfigError(
                    f"topology.tp={tp} is refused for this model's recurrent layers: allowed "
                    f"is a divisor of its {counts} (its {count} {name} do not split)"
                )

    def conv_channels(self, tp_rank: int, tp: int) -> torch.Tensor:
        """The conv state channels TP rank ``tp_rank`` of ``tp`` holds."""
        out, offset = [], 0
        for _, n in self.segments:
            out.append(offset + torch.arange(n).view(tp, -1)[tp_rank])
            offset += n
        return torch.cat(out)

    def share(self, conv: torch.Tensor, recurrent: torch.Tensor, tp_rank: int, tp: int):
        """TP rank ``tp_rank``'s share of one layer's state, flat: the conv state of
        its channels, then the recurrent state of its heads."""
        heads = self.heads // tp
        mine = conv[0, self.conv_channels(tp_rank, tp)]
        rec = recurrent[0, tp_rank * heads : (tp_rank + 1) * heads]
        return torch.cat([mine.flatten(), rec.flatten()])

    def from_shares(self, shares: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's ``(conv, recurrent)`` put back together from every TP rank's
        ``share``, in rank order."""
        tp = len(shares)
        conv = torch.empty(1, self.channels, self.kernel)
        recurrent = torch.empty(1, self.heads, *self.head_shape)
        heads = self.heads // tp
        for r, flat in enumerate(shares):
            idx = self.conv_channels(r, tp)
            n = len(idx) * self.kernel
            conv[0, idx] = flat[:n].view(len(idx), self.kernel)
            recurrent[0, r * heads : (r + 1) * heads] = flat[n:].view(heads, *self.head_shape)
        return conv, recurrent
