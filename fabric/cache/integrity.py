"""Every invariant of the cache, recomputed from scratch (SPEC §3)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from fabric.cache.controller import Controller
from fabric.cache.keys import chain_hashes, namespace_seed
from fabric.cache.l3_transfers import L3Transfers
from fabric.cache.loads import LoadBacks
from fabric.cache.node import TreeNode
from fabric.cache.pins import Pins
from fabric.cache.placement import Placement
from fabric.cache.radix import RadixTree
from fabric.cache.results import TierSizes
from fabric.cache.sessions import Sessions
from fabric.cache.writes import Writes
from fabric.errors import IntegrityError
from policies import WritePolicy


class CacheState(Protocol):
    """What the check reads of a cache (``HiCache`` has it all)."""

    tree: RadixTree
    ctl: Controller
    l3: L3Transfers
    write_policy: WritePolicy
    placement: Placement
    writes: Writes
    loads: LoadBacks
    pins: Pins
    sessions: Sessions

    def device_sizes(self) -> TierSizes: ...

    def host_sizes(self) -> TierSizes: ...


def check_integrity(cache: CacheState) -> None:
    """Raise ``IntegrityError`` listing every violation; return quietly otherwise."""
    nodes = cache.tree.walk()
    violations = [v for check in CHECKS for v in check(cache, nodes)]
    if violations:
        raise IntegrityError(violations)


def links(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Each child hangs under its own key and namespace; counts of device children and
    lock references add up."""
    root = cache.tree.root
    pb = cache.tree.page_bytes
    for node in [root, *nodes]:
        on_device = sum(1 for c in node.children.values() if c.device_value is not None)
        if node.device_children != on_device:
            yield f"{node}: device_children={node.device_children}, counted {on_device}"
        for ck, child in node.children.items():
            if child.parent is not node or ck != (child.namespace, child.key[:pb]):
                yield f"{child}: child key or parent link does not match its parent {node}"
            if node is not root and child.namespace != node.namespace:
                yield f"{child}: namespace differs from its parent's"
        if node.lock_ref < 0 or node.host_ref < 0:
            yield f"{node}: negative lock_ref={node.lock_ref} or host_ref={node.host_ref}"
        if node is not root and node.lock_ref < sum(c.lock_ref for c in node.children.values()):
            yield f"{node}: lock_ref {node.lock_ref} below the sum of its children's"


def values(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Keys are whole pages; each node holds its pages in L1 or L2, as many as its key;
    its page hashes are the chain over its key (they are L3 addresses: a wrong one
    would file KV under another prefix)."""
    root = cache.tree.root
    pb = cache.tree.page_bytes
    for node in nodes:
        pages = len(node.key) // pb
        if not node.key or len(node.key) % pb:
            yield f"{node}: key of {len(node.key)} bytes is not whole pages"
        if node.device_value is None and node.host_value is None:
            yield f"{node}: holds data in neither L1 nor L2"
        for name, value in (("device", node.device_value), ("host", node.host_value)):
            if value is not None and len(value) != pages:
                yield f"{node}: {name} value has {len(value)} pages, key has {pages}"
        if node.page_hashes is not None:
            parent_hashes = node.parent.page_hashes if node.parent is not root else None
            if node.parent is root or parent_hashes is not None:
                prev = parent_hashes[-1] if parent_hashes else namespace_seed(node.namespace)
                if node.page_hashes != chain_hashes(prev, node.key, pb):
                    yield f"{node}: page hashes differ from the chain over its key"


def prefix_closed(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """L1 holds whole prefixes, and so does L2 under write-through; only L1 nodes are
    locked."""
    root = cache.tree.root
    write_through = not cache.write_policy.write_back
    for node in nodes:
        parent = node.parent
        assert parent is not None
        if node.device_value is not None:
            if parent is not root and parent.device_value is None:
                yield f"{node}: on device but its parent is not (L1 not prefix-closed)"
        elif node.lock_ref:
            yield f"{node}: locked but not on device"
        host_gap = parent is not root and parent.host_value is None
        if node.host_value is not None and write_through and host_gap:
            yield f"{node}: in L2 but its parent is not (L2 not prefix-closed)"


def l1_counters(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """The tree's evictable and protected L1 sizes match its nodes."""
    tree = cache.tree
    on_device = [n for n in nodes if n.device_value is not None]
    protected = sum(tree.tokens(n) for n in on_device if n.lock_ref)
    evictable = sum(tree.tokens(n) for n in on_device if not n.lock_ref)
    if tree.evictable_size != evictable or tree.protected_size != protected:
        yield (
            f"L1 counters evictable={tree.evictable_size} protected={tree.protected_size}, "
            f"recomputed {evictable} and {protected}"
        )


def leaf_sets(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """The eviction queues hold exactly the evictable leaves of each tier, each with a
    heap entry."""
    tree = cache.tree
    device = {
        n for n in nodes if n.device_value is not None and not n.lock_ref and not n.device_children
    }
    host = {n for n in nodes if n.device_value is None and not n.children}
    for name, queue, expected in (
        ("device", tree.device_leaves, device),
        ("host", tree.host_leaves, host),
    ):
        if queue.members != expected:
            yield f"{name} leaf set differs from recomputation by {queue.members ^ expected}"
        if queue.queued() != queue.members:
            yield f"{name} leaves without a heap entry: {queue.members - queue.queued()}"


def pins(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Pinned sizes, in all and per tenant, match the pinned nodes and the budget."""
    pinned_by: Counter[str] = Counter()
    for node in nodes:
        if node.pinned:
            pinned_by[node.namespace] += cache.tree.tokens(node)
    pinned = sum(pinned_by.values())
    if cache.pins.pinned_size != pinned:
        yield f"pinned_size={cache.pins.pinned_size}, recomputed {pinned}"
    if cache.pins.by_tenant != dict(pinned_by):
        yield f"pinned per tenant {cache.pins.by_tenant}, recomputed {dict(pinned_by)}"
    if any(n > cache.pins.tenant_budget for n in pinned_by.values()):
        yield f"a tenant pins more than {cache.pins.tenant_budget}: {dict(pinned_by)}"


def operations(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Every pending write, load, backup and prefetch holds a live node that it keeps
    locked or protected."""
    live = set(nodes)
    root = cache.tree.root
    for op in cache.writes.pending:
        if op.lock_node not in live or op.lock_node.lock_ref <= 0:
            yield f"write op {op.op_id} holds {op.lock_node}, which is gone or unlocked"
    for op_id, node in cache.loads.pending:
        if node not in live or node.lock_ref <= 0:
            yield f"load op {op_id} holds {node}, which is gone or unlocked"
    for bop in cache.l3.backups:
        if bop.node not in live or bop.node.host_ref <= 0 or bop.node.host_value is None:
            yield f"backup op {bop.op_id} holds {bop.node}, which is gone or unprotected"
    for pop in cache.l3.prefetches.values():
        if pop.anchor is not root and (pop.anchor not in live or pop.anchor.host_ref <= 0):
            yield f"prefetch {pop.req_id!r} anchors on {pop.anchor}, gone or unprotected"


def sessions(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Session tokens, in all and per tenant, match the sessions held and the budget;
    each session holds a live node (locked when sessions keep L1)."""
    held_sessions = cache.sessions
    session_tokens: Counter[str] = Counter()
    for held in held_sessions.held.values():
        session_tokens[held.node.namespace] += held.tokens
    total = sum(session_tokens.values())
    if held_sessions.by_tenant != dict(session_tokens):
        yield (
            f"session tokens per tenant {held_sessions.by_tenant}, "
            f"recomputed {dict(session_tokens)}"
        )
    if total != held_sessions.held_tokens:
        yield f"session tokens {held_sessions.held_tokens}, recomputed {total}"
    if any(n > held_sessions.tenant_budget for n in session_tokens.values()):
        yield (
            f"a tenant's sessions hold more than {held_sessions.tenant_budget}: "
            f"{dict(session_tokens)}"
        )
    live = set(nodes)
    device_tier = held_sessions.tier == "device"
    for sid, held in held_sessions.held.items():
        if held.node not in live or (device_tier and held.node.lock_ref <= 0):
            yield f"session {sid!r} holds {held.node}, which is gone or unlocked"


def host_refs(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """A node's host_ref counts exactly the pins, sessions, backups and prefetches that
    hold it."""
    root = cache.tree.root
    holds: Counter[TreeNode] = Counter(n for n in nodes if n.pinned)
    holds.update(cache.sessions.host_held())
    holds.update(bop.node for bop in cache.l3.backups)
    holds.update(pop.anchor for pop in cache.l3.prefetches.values() if pop.anchor is not root)
    for node in nodes:
        if node.host_ref != holds[node]:
            yield (
                f"{node}: host_ref={node.host_ref} but {holds[node]} "
                "pins/sessions/backups/prefetches hold it"
            )


def pages_owned_once(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Each L1 and L2 page is free or has one owner (a node, a lease, a pending write's
    orphans, a prefetch), never both, and free plus owned is the pool."""
    device_owner: Counter[int] = Counter()
    host_owner: Counter[int] = Counter()
    for node in nodes:
        if node.device_value is not None:
            device_owner.update(node.device_value)
        if node.host_value is not None:
            host_owner.update(node.host_value)
    device_owner.update(cache.placement.leased)
    for op in cache.writes.pending:
        host_owner.update(op.orphan_pages)
    for pop in cache.l3.by_op.values():
        host_owner.update(pop.host_pages)
    for name, pool, owner in (
        ("L1", cache.ctl.device, device_owner),
        ("L2", cache.ctl.host, host_owner),
    ):
        twice = sorted(p for p, n in owner.items() if n > 1)
        if twice:
            yield f"{name}: pages {twice[:10]} owned twice"
        free_and_owned = sorted(p for p in owner if pool.is_free(p))
        if free_and_owned:
            yield f"{name}: pages {free_and_owned[:10]} both free and owned"
        yield from pool.violations()
        if pool.available_pages + len(owner) != pool.num_pages:
            yield (
                f"{name}: {pool.available_pages} free + {len(owner)} owned pages "
                f"!= capacity {pool.num_pages}"
            )


def tier_sizes(cache: CacheState, nodes: list[TreeNode]) -> Iterator[str]:
    """Each tier's (and each component's) free, evictable and protected sizes add up
    to its capacity; a hybrid model's components keep their own invariants."""
    tree = cache.tree
    sizes = [("L1", cache.device_sizes()), ("L2", cache.host_sizes())]
    if tree.parts is not None:
        yield from tree.parts.violations(nodes, tree.pages, cache.l3.held_host_parts())
        sizes += [(f"L1 {c}", s) for c, s in tree.parts.sizes(nodes).items()]
    for name, size in sizes:
        if size.free + size.evictable + size.protected != size.capacity:
            yield f"{name}: free + evictable + protected != capacity ({size})"


CHECKS: tuple[Callable[[CacheState, list[TreeNode]], Iterable[str]], ...] = (
    links,
    values,
    prefix_closed,
    l1_counters,
    leaf_sets,
    pins,
    operations,
    sessions,
    host_refs,
    pages_owned_once,
    tier_sizes,
)
"""Each invariant as its own check, in the order its violations are listed."""
