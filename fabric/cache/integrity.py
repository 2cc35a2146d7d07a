"""Every invariant of the cache, recomputed from scratch (SPEC §3)."""

from __future__ import annotations

from collections import Counter, deque
from typing import Protocol

from fabric.cache.controller import Controller
from fabric.cache.keys import chain_hashes, namespace_seed
from fabric.cache.l3_queues import L3Queues
from fabric.cache.node import TreeNode, WriteOp
from fabric.cache.radix import RadixTree
from fabric.cache.results import TierSizes
from fabric.cache.sessions import Sessions
from fabric.errors import IntegrityError
from policies import WritePolicy


class CacheState(Protocol):
    """What the check reads of a cache (``HiCache`` has it all)."""

    tree: RadixTree
    ctl: Controller
    storage: L3Queues
    write_policy: WritePolicy
    leased: set[int]
    pending_writes: deque[WriteOp]
    pending_loads: deque[tuple[int, TreeNode]]
    pinned_size: int
    sessions: Sessions

    def device_sizes(self) -> TierSizes: ...

    def host_sizes(self) -> TierSizes: ...


def check_integrity(cache: CacheState) -> None:
    """Raise ``IntegrityError`` listing every violation; return quietly otherwise."""
    v: list[str] = []
    tree = cache.tree
    root = tree.root
    pb = tree.page_bytes
    nodes = tree.walk()
    live = set(nodes)
    device_owner: Counter[int] = Counter()
    host_owner: Counter[int] = Counter()
    evictable = protected = 0
    device_leaves: set[TreeNode] = set()
    host_leaves: set[TreeNode] = set()
    pinned = 0
    pinned_by: Counter[str] = Counter()
    write_through = not cache.write_policy.write_back

    for node in [root, *nodes]:
        on_device = sum(1 for c in node.children.values() if c.device_value is not None)
        if node.device_children != on_device:
            v.append(f"{node}: device_children={node.device_children}, counted {on_device}")
        for ck, child in node.children.items():
            if child.parent is not node or ck != (child.namespace, child.key[:pb]):
                v.append(f"{child}: child key or parent link does not match its parent {node}")
            if node is not root and child.namespace != node.namespace:
                v.append(f"{child}: namespace differs from its parent's")
        if node.lock_ref < 0 or node.host_ref < 0:
            v.append(f"{node}: negative lock_ref={node.lock_ref} or host_ref={node.host_ref}")
        if node is not root and node.lock_ref < sum(c.lock_ref for c in node.children.values()):
            v.append(f"{node}: lock_ref {node.lock_ref} below the sum of its children's")

    for node in nodes:
        pages = len(node.key) // pb
        if not node.key or len(node.key) % pb:
            v.append(f"{node}: key of {len(node.key)} bytes is not whole pages")
        if node.device_value is None and node.host_value is None:
            v.append(f"{node}: holds data in neither L1 nor L2")
        for name, value in (("device", node.device_value), ("host", node.host_value)):
            if value is not None and len(value) != pages:
                v.append(f"{node}: {name} value has {len(value)} pages, key has {pages}")
        if node.page_hashes is not None:
            # Hashes are L3 addresses: a wrong one would file KV under another prefix.
            parent_hashes = node.parent.page_hashes if node.parent is not root else None
            if node.parent is root or parent_hashes is not None:
                prev = parent_hashes[-1] if parent_hashes else namespace_seed(node.namespace)
                if node.page_hashes != chain_hashes(prev, node.key, pb):
                    v.append(f"{node}: page hashes differ from the chain over its key")
        parent = node.parent
        assert parent is not None
        if node.device_value is not None:
            device_owner.update(node.device_value)
            if parent is not root and parent.device_value is None:
                v.append(f"{node}: on device but its parent is not (L1 not prefix-closed)")
            if node.lock_ref:
                protected += tree.tokens(node)
            else:
                evictable += tree.tokens(node)
        elif node.lock_ref:
            v.append(f"{node}: locked but not on device")
        if node.host_value is not None:
            host_owner.update(node.host_value)
            if write_through and parent is not root and parent.host_value is None:
                v.append(f"{node}: in L2 but its parent is not (L2 not prefix-closed)")
        if node.pinned:
            pinned += tree.tokens(node)
            pinned_by[node.namespace] += tree.tokens(node)
        if node.device_value is not None and not node.lock_ref and not node.device_children:
            device_leaves.add(node)
        if node.device_value is None and not node.children:
            host_leaves.add(node)

    if tree.evictable_size != evictable or tree.protected_size != protected:
        v.append(
            f"L1 counters evictable={tree.evictable_size} protected={tree.protected_size}, "
            f"recomputed {evictable} and {protected}"
        )
    for name, queue, expected in (
        ("device", tree.device_leaves, device_leaves),
        ("host", tree.host_leaves, host_leaves),
    ):
        if queue.members != expected:
            v.append(f"{name} leaf set differs from recomputation by {queue.members ^ expected}")
        if queue.queued() != queue.members:
            v.append(f"{name} leaves without a heap entry: {queue.members - queue.queued()}")
    if cache.pinned_size != pinned:
        v.append(f"pinned_size={cache.pinned_size}, recomputed {pinned}")
    if cache.pins.by_tenant != dict(pinned_by):
        v.append(f"pinned per tenant {cache.pins.by_tenant}, recomputed {dict(pinned_by)}")
    if any(n > cache.pins.tenant_budget for n in pinned_by.values()):
        v.append(f"a tenant pins more than {cache.pins.tenant_budget}: {dict(pinned_by)}")

    device_owner.update(cache.leased)
    for op in cache.pending_writes:
        host_owner.update(op.orphan_pages)
        if op.lock_node not in live or op.lock_node.lock_ref <= 0:
            v.append(f"write op {op.op_id} holds {op.lock_node}, which is gone or unlocked")
    for op_id, node in cache.pending_loads:
        if node not in live or node.lock_ref <= 0:
            v.append(f"load op {op_id} holds {node}, which is gone or unlocked")
    for bop in cache.storage.backups:
        if bop.node not in live or bop.node.host_ref <= 0 or bop.node.host_value is None:
            v.append(f"backup op {bop.op_id} holds {bop.node}, which is gone or unprotected")
    for pop in cache.storage.by_op.values():
        host_owner.update(pop.host_pages)
    for pop in cache.storage.prefetches.values():
        if pop.anchor is not root and (pop.anchor not in live or pop.anchor.host_ref <= 0):
            v.append(f"prefetch {pop.req_id!r} anchors on {pop.anchor}, gone or unprotected")

    session_tokens: Counter[str] = Counter()
    for held in cache.sessions.held.values():
        session_tokens[held.node.namespace] += held.tokens
    if cache.sessions.by_tenant != dict(session_tokens):
        v.append(
            f"session tokens per tenant {cache.sessions.by_tenant}, recomputed {dict(session_tokens)}"
        )
    if sum(session_tokens.values()) != cache.sessions.held_tokens:
        v.append(
            f"session tokens {cache.sessions.held_tokens}, recomputed {sum(session_tokens.values())}"
        )
    if any(n > cache.sessions.tenant_budget for n in session_tokens.values()):
        v.append(
            f"a tenant's sessions hold more than {cache.sessions.tenant_budget}: {dict(session_tokens)}"
        )
    for sid, held in cache.sessions.held.items():
        device_tier = cache.sessions.tier == "device"
        if held.node not in live or (device_tier and held.node.lock_ref <= 0):
            v.append(f"session {sid!r} holds {held.node}, which is gone or unlocked")
    holds: Counter[TreeNode] = Counter(n for n in nodes if n.pinned)
    holds.update(cache.sessions.host_held())
    holds.update(bop.node for bop in cache.storage.backups)
    holds.update(pop.anchor for pop in cache.storage.prefetches.values() if pop.anchor is not root)
    for node in nodes:
        if node.host_ref != holds[node]:
            v.append(
                f"{node}: host_ref={node.host_ref} but {holds[node]} pins/sessions/backups/prefetches hold it"
            )

    for name, pool, owner in (
        ("L1", cache.ctl.device, device_owner),
        ("L2", cache.ctl.host, host_owner),
    ):
        twice = sorted(p for p, n in owner.items() if n > 1)
        if twice:
            v.append(f"{name}: pages {twice[:10]} owned twice")
        free_and_owned = sorted(p for p in owner if pool.is_free(p))
        if free_and_owned:
            v.append(f"{name}: pages {free_and_owned[:10]} both free and owned")
        v.extend(pool.violations())
        if pool.available_pages + len(owner) != pool.num_pages:
            v.append(
                f"{name}: {pool.available_pages} free + {len(owner)} owned pages "
                f"!= capacity {pool.num_pages}"
            )
    tier_sizes = [("L1", cache.device_sizes()), ("L2", cache.host_sizes())]
    if tree.parts is not None:
        v.extend(tree.parts.violations(nodes, tree.pages, cache.storage.held_host_parts()))
        tier_sizes += [(f"L1 {c}", s) for c, s in tree.parts.sizes(nodes).items()]
    for name, sizes in tier_sizes:
        if sizes.free + sizes.evictable + sizes.protected != sizes.capacity:
            v.append(f"{name}: free + evictable + protected != capacity ({sizes})")
    if v:
        raise IntegrityError(v)
