"""The radix tree's node, and the in-flight L1 -> L2 write a node may belong to."""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

_ids = itertools.count(1)


class TreeNode:
    """One edge of the radix tree: a run of whole pages under one parent.

    ``key`` is the packed tokens of the run (see ``fabric.cache.keys``); ``device_value``
    and ``host_value`` are page indices in the L1 and L2 pools, ``None`` when the
    run is not in that tier. ``lock_ref`` counts L1 protections along the path
    to the root (a lock on a node is counted on each ancestor too); ``host_ref``
    counts L2 protections of this node alone (in-flight backups, prefetch
    anchors, pins). ``device_children`` counts children with a device value.
    ``page_hashes`` is ``None`` until first needed. ``sliding``, ``mamba`` and their
    locks are a hybrid model's other components (``fabric.cache.components``).
    ``places`` is an engine page's residency (``fabric.cache.engine_index``): per
    place, the mask of the ranks whose shard is there; ``children_in`` counts,
    per place, the children that are there.
    """

    __slots__ = (
        "children",
        "children_in",
        "created",
        "device_children",
        "device_value",
        "hit_count",
        "host_mamba",
        "host_ref",
        "host_sliding",
        "host_value",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "mamba",
        "namespace",
        "page_hashes",
        "parent",
        "part_ref",
        "pin_expiry",
        "pin_ttl",
        "places",
        "priority",
        "sliding",
        "sliding_locks",
        "write_op",
    )

    def __init__(
        self,
        key: bytes,
        namespace: str,
        parent: TreeNode | None,
        now: float,
        priority: int = 0,
    ) -> None:
        self.id = next(_ids)
        self.key = key
        self.namespace = namespace
        self.parent = parent
        self.children: dict[tuple[str, bytes], TreeNode] = {}
        self.device_value: array | None = None
        self.host_value: array | None = None
        self.device_children = 0
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = now
        self.created = now
        self.priority = priority
        self.page_hashes: list[bytes] | None = None
        self.pin_expiry = 0.0
        self.pin_ttl = 0.0
        self.write_op: WriteOp | None = None
        self.sliding: array | None = None
        self.sliding_locks: dict[int, int] | None = None
        self.mamba: int | None = None
        self.part_ref = 0
        self.host_sliding: array | None = None
        self.host_mamba: int | None = None
        self.places: dict[str, int] | None = None
        self.children_in: dict[str, int] | None = None

    @property
    def on_device(self) -> bool:
        return self.device_value is not None

    @property
    def backed_up(self) -> bool:
        return self.host_value is not None

    @property
    def pinned(self) -> bool:
        return self.pin_expiry > 0

    def __repr__(self) -> str:
        tiers = ("D" if self.on_device else "") + ("H" if self.backed_up else "")
        return f"TreeNode(id={self.id}, bytes={len(self.key)}, tiers={tiers or '-'}, lock={self.lock_ref})"


@dataclass(eq=False)
class WriteOp:
    """An in-flight L1 -> L2 copy of ``nodes`` (ancestors first; splits append).
    ``lock_node`` holds one lock for the whole path; ``orphan_pages`` are host
    pages already taken from their nodes, freed when the copy completes."""

    op_id: int
    nodes: list[TreeNode]
    lock_node: TreeNode
    evict_after: bool
    orphan_pages: list[int] = field(default_factory=list)
    # A hybrid model's components alone, copied to L2 after the node's pages
    # (``nodes`` is empty): the L2 sliding pages and mamba slots they fill.
    part_slots: tuple[tuple[int, ...], tuple[int, ...]] | None = None
