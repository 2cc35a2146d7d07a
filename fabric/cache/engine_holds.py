"""Sessions and pins for engine pages: a prefix an engine served kept in every
place it is in until a TTL passes — the fabric's own ``Sessions``
(``fabric.cache.sessions``) over the engine tree.

- A **session** (a conversation's id) holds its turn's pages for
  ``cache.session_ttl_s``: the next turn names the same id and takes over, so
  the conversation's prefix is never evicted between turns.
- A **pin** holds a prefix for the TTL its engine asked for (at most
  ``MAX_PIN_S``), under a name of its own.

A held node is locked (``Places.lock``: no place evicts it or a page before
it). Each kind holds at most its share of L3's cap in bytes
(``cache.session_budget_fraction``, ``cache.pin_budget_fraction``; a whole page
counts every rank's shard), one tenant (the namespace before any ``/``) at most
``cache.tenant_share`` of that; the least recently kept go first, the tenant's
own when its share is full. An L3 without a cap bounds neither.

An engine asks as its request ends, before its last pages' stores are
reported: a hold reaches the pages the tree knows, and waits (bounded) for the
rest, moving down the path as they are reported. Nothing here imports Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fabric.cache.engine_places import Places, tenant_of
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree
from fabric.cache.sessions import Sessions, check_session_id
from fabric.errors import InvalidInput

SESSION = "session"
PIN = "pin"
HOLDS = (SESSION, PIN)
MAX_PIN_S = 7 * 24 * 3600.0
# Holds whose last pages are not reported yet, waiting for them (the oldest let
# go beyond: it keeps what it reached).
MAX_AWAITING = 4096
UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class HoldOptions:
    """Budgets as shares of L3's cap in bytes (0: no cap, no bound)."""

    l3_bytes: int = 0
    session_fraction: float = 0.25
    pin_fraction: float = 0.2
    tenant_share: float = 0.5
    session_ttl_s: float = 300.0


@dataclass
class _Awaiting:
    kind: str
    name: str
    chain: tuple[bytes, ...]
    until: float


class EngineHolds:
    """The holds of one engine tree: ``walk(tag, world, chain)`` gives the node of
    the chain's deepest page the tree knows and how many pages that is;
    ``unlock(node)`` lets a hold's lock go (and prunes); ``page_bytes(node)`` is
    a whole page of the node's engine."""

    def __init__(
        self,
        tree: RadixTree,
        options: HoldOptions,
        walk: Callable[[str, int, Sequence[bytes]], tuple[TreeNode | None, int]],
        unlock: Callable[[TreeNode], None],
        page_bytes: Callable[[TreeNode], int],
    ) -> None:
        self.walk = walk
        self.now = 0.0
        self.awaiting: OrderedDict[tuple[str, int, bytes], _Awaiting] = OrderedDict()

        def size(node: TreeNode) -> int:
            return tree.depth_pages(node) * max(page_bytes(node), 1)

        self.kinds: dict[str, Sessions] = {}
        for kind, fraction in ((SESSION, options.session_fraction), (PIN, options.pin_fraction)):
            budget = int(fraction * options.l3_bytes) if options.l3_bytes else UNBOUNDED
            self.kinds[kind] = Sessions(
                tree,
                budget,
                options.session_ttl_s,
                "device",  # a lock: kept in every place
                lambda: self.now,
                lambda node: 0,
                unlock,
                int(options.tenant_share * budget),
                size=size,
                tenant=tenant_of,
                unit="bytes",
            )

    def hold(
        self,
        tag: str,
        world: int,
        chain: Sequence[bytes],
        name: str,
        kind: str,
        ttl_s: float | None,
        now: float,
    ) -> str | None:
        """Hold the pages of ``chain`` (one prefix, from its first page) under
        ``name`` of ``kind`` for ``ttl_s`` (a session's: the configured TTL), in
        place of what the name held before; ``None``, or why nothing is held."""
        check_hold(name, kind, ttl_s)
        self.expire(now)
        ttl = self.kinds[kind].ttl_s if ttl_s is None else ttl_s
        key = (tag, world, chain[-1]) if chain else None
        if key is not None:
            self.awaiting.pop(key, None)
        why, depth = self._keep(tag, world, chain, name, kind, ttl)
        if key is not None and depth < len(chain):  # its last pages are on their way
            self.awaiting[key] = _Awaiting(kind, name, tuple(chain), now + ttl)
            while len(self.awaiting) > MAX_AWAITING:
                self.awaiting.popitem(last=False)
        return why

    def _keep(
        self, tag: str, world: int, chain: Sequence[bytes], name: str, kind: str, ttl: float
    ) -> tuple[str | None, int]:
        """Hold what the tree knows of ``chain``: why not, and how many pages."""
        node, depth = self.walk(tag, world, chain)
        if node is None:
            self.kinds[kind].end(name)
            return "no page of it is known", 0
        Places.lock(node, +1)  # passed on to the hold (let go if it is refused)
        return self.kinds[kind].keep(name, node, ttl), depth

    def reported(self, tag: str, world: int, hashes: Sequence[bytes], now: float) -> None:
        """Pages were reported: holds waiting for them move down to them."""
        if not self.awaiting:
            return
        for h in hashes:
            waiting = self.awaiting.get((tag, world, h))
            if waiting is None or waiting.until <= now:
                continue
            self.now = max(self.now, now)
            del self.awaiting[(tag, world, h)]
            self._keep(tag, world, waiting.chain, waiting.name, waiting.kind, waiting.until - now)

    def expire(self, now: float) -> int:
        """End the holds whose TTL passed at ``now``; how many."""
        self.now = max(self.now, now)
        if self.awaiting:
            self.awaiting = OrderedDict((k, w) for k, w in self.awaiting.items() if w.until > now)
        return sum(kind.expire() for kind in self.kinds.values())

    def figures(self) -> dict[str, dict[str, int]]:
        """Per kind: holds, bytes held, and bytes per tenant."""
        return {
            name: {
                "held": len(kind.held),
                "bytes": kind.held_tokens,
                "budget": kind.budget if kind.budget < UNBOUNDED else 0,
                "tenants": dict(kind.by_tenant),
            }
            for name, kind in self.kinds.items()
        }


def check_hold(name: object, kind: object, ttl_s: object) -> None:
    check_session_id(name)
    if kind not in HOLDS:
        raise InvalidInput(f"hold kind {kind!r} is refused: allowed is one of {HOLDS}")
    if ttl_s is not None and (
        isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_PIN_S
    ):
        raise InvalidInput(
            f"hold ttl_s {ttl_s!r} is refused: allowed is a number in (0, {MAX_PIN_S:.0f}]"
        )
