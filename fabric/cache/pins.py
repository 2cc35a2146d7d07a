"""Pins: prefixes kept in L2 until a TTL passes (refreshed by hits), within a
budget — a share of L2 — of which one tenant (namespace) holds at most
``tenant_budget``, so one tenant cannot take it all. A pinned node holds one host
protection; nodes not yet in L2 are written through when pinned. A pin whose TTL
passed gives its budget back at the next ``expire`` (each coordinator step, and
before any new pin), without waiting for an eviction to reach its node."""

from __future__ import annotations

import math
from collections.abc import Callable

from fabric.cache.keys import TokenKey
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree
from fabric.cache.results import PinResult
from fabric.errors import InvalidInput


class Pins:
    def __init__(
        self,
        tree: RadixTree,
        budget: int,
        clock: Callable[[], float],
        tenant_budget: int | None = None,
    ) -> None:
        self.tree = tree
        self.budget = budget
        self.tenant_budget = budget if tenant_budget is None else min(tenant_budget, budget)
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.pinned_size = 0
        self.by_tenant: dict[str, int] = {}  # pinned tokens per namespace
        # Nodes pinned here (a split's upper half inherits its child's pin: found
        # from the child), and the earliest expiry among them: ``expire`` does
        # nothing before it.
        self.nodes: set[TreeNode] = set()
        self._next_expiry = math.inf

    def expire(self, now: float | None = None) -> int:
        """Unpin every node whose TTL passed; returns the tokens given back."""
        now = self.clock() if now is None else now
        if now <= self._next_expiry:
            return 0
        candidates: set[TreeNode] = set()
        for node in self.nodes:
            up: TreeNode | None = node
            while up is not None and up.pinned and up not in candidates:
                candidates.add(up)
                up = up.parent
        freed = 0
        for node in candidates:
            if node.pin_expiry < now:
                freed += self.tree.tokens(node)
                self.clear(node)
        self.nodes = {n for n in candidates if n.pinned}
        self._next_expiry = min((n.pin_expiry for n in self.nodes), default=math.inf)
        return freed

    def pin(
        self, key: TokenKey, ttl_s: float, write_backup: Callable[[TreeNode], int]
    ) -> PinResult:
        """Keep ``key``'s cached prefix in L2 for ``ttl_s`` seconds, within the budget;
        says how much was pinned and why not more. A pinned node not yet in L2 is
        copied there (``write_backup``, the cache's ``Writes.write_backup``)."""
        if (
            not isinstance(ttl_s, (int, float))
            or isinstance(ttl_s, bool)
            or not 0 < ttl_s < math.inf
        ):
            raise InvalidInput(f"pin ttl_s={ttl_s!r} is refused: allowed is a finite number > 0")
        now = self.clock()
        self.expire(now)  # budgets whose holders' time is up come back first
        tree = self.tree
        path = tree.descend(tree.root, key.namespace, key.data, 0, len(key.data), now)
        pinned = 0
        reason = None
        for node in path:
            tokens = tree.tokens(node)
            if not node.pinned:
                if self.pinned_size + tokens > self.budget:
                    reason = (
                        f"pin budget exhausted ({self.pinned_size}/{self.budget} tokens pinned)"
                    )
                    break
                held = self.by_tenant.get(node.namespace, 0)
                if held + tokens > self.tenant_budget:
                    reason = (
                        f"tenant {node.namespace!r} pin budget exhausted ({held}/"
                        f"{self.tenant_budget} tokens pinned; cache.tenant_share)"
                    )
                    break
                node.host_ref += 1
                self.pinned_size += tokens
                self.by_tenant[node.namespace] = held + tokens
                if node.host_value is None:
                    write_backup(node)
            node.pin_expiry = max(node.pin_expiry, now + ttl_s)
            node.pin_ttl = max(node.pin_ttl, float(ttl_s))
            self.nodes.add(node)
            self._next_expiry = min(self._next_expiry, node.pin_expiry)
            pinned += tokens
        if reason is None and pinned < key.num_tokens:
            reason = f"only {pinned} of {key.num_tokens} tokens are cached"
        return PinResult(pinned, reason)

    def unpin(self, key: TokenKey) -> int:
        """Unpin the nodes of ``key``'s cached prefix; returns the tokens unpinned.
        A node shared with another pinned prefix is unpinned too (pins are per
        node); that prefix's own deeper nodes stay pinned."""
        tree = self.tree
        path = tree.descend(tree.root, key.namespace, key.data, 0, len(key.data), self.clock())
        unpinned = 0
        for node in path:
            if node.pinned:
                unpinned += tree.tokens(node)
                self.clear(node)
        return unpinned

    def clear(self, node: TreeNode) -> None:
        """Unpin ``node`` (its TTL passed, or it is being deleted)."""
        tokens = self.tree.tokens(node)
        self.pinned_size -= tokens
        left = self.by_tenant[node.namespace] - tokens
        if left:
            self.by_tenant[node.namespace] = left
        else:
            del self.by_tenant[node.namespace]
        node.host_ref -= 1
        node.pin_expiry = node.pin_ttl = 0.0
        self.nodes.discard(node)
