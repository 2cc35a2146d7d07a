"""Write policies: when a device-resident node is copied to host memory (L2).

``hit_threshold`` is the hit count at which a node is written through; ``None``
means never on a hit — the node is written back only when L1 evicts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.registry import unknown_name


@dataclass(frozen=True)
class WritePolicy:
    name: str
    hit_threshold: int | None

    @property
    def write_back(self) -> bool:
        return self.hit_threshold is None


WRITE_POLICIES: dict[str, WritePolicy] = {
    p.name: p
    for p in (
        WritePolicy("write_through", 1),
        WritePolicy("write_through_selective", 2),
        WritePolicy("write_back", None),
    )
}


def get_write_policy(name: str) -> WritePolicy:
    """The policy called ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return WRITE_POLICIES[name]
    except (KeyError, TypeError):
        raise unknown_name("write policy", name, WRITE_POLICIES) from None
