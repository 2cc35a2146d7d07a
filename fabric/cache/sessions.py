"""Sessions: a conversation's cached prefix kept warm between its turns.

When a turn ends, its session takes over the request's lock on the last node of
its whole pages, so the next turn (that prompt, the answer, a new message)
finds it in place. ``tier="device"`` keeps the lock: the prefix stays in L1.
``tier="host"`` trades it for a host protection on that node (written to L2
first if it is not there), so the prefix may leave L1 but stays in L2: an L2
node with a child is never an L2 eviction candidate, so protecting the last node
keeps the path. All sessions together hold at most ``budget`` tokens, one
tenant's (namespace's) at most ``tenant_budget`` (the least recently kept go
first: the tenant's own when its share is full); each is dropped when its TTL
passes without a new turn or when it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree
from fabric.config import SESSION_TIERS, CacheConfig
from fabric.errors import InvalidInput

MAX_SESSION_ID_CHARS = 256


@dataclass(eq=False, slots=True)
class Held:
    node: TreeNode
    tokens: int
    expires_at: float
    tenant: str


class Sessions:
    def __init__(
        self,
        tree: RadixTree,
        budget: int,
        ttl_s: float,
        tier: str,
        clock: Callable[[], float],
        write_backup: Callable[[TreeNode], int],
        unlock: Callable[[TreeNode], None] | None = None,
        tenant_budget: int | None = None,
        *,
        size: Callable[[TreeNode], int] | None = None,
        tenant: Callable[[TreeNode], str] | None = None,
        unit: str = "tokens",
    ) -> None:
        """``size`` and ``unit``: what a node held costs of the budget (its tokens
        from the root by default); ``tenant``: whose share it counts in (its
        namespace by default)."""
        if tier not in SESSION_TIERS:
            raise InvalidInput(
                f"session tier {tier!r} is refused: allowed is one of {SESSION_TIERS}"
            )
        self.tree = tree
        self.budget = budget
        self.tenant_budget = budget if tenant_budget is None else min(tenant_budget, budget)
        self.ttl_s = ttl_s
        self.tier = tier
        self.clock = clock
        self.write_backup = write_backup
        # Drops a request's lock (``Placement.dec_lock_ref``: its components' too).
        self.unlock = unlock or tree.dec_lock_ref
        self.size = size or (lambda node: tree.depth_pages(node) * tree.page_size)
        self.tenant = tenant or (lambda node: node.namespace)
        self.unit = unit
        self.reset()

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        tree: RadixTree,
        clock: Callable[[], float],
        write_backup: Callable[[TreeNode], int],
        unlock: Callable[[TreeNode], None] | None = None,
    ) -> Sessions:
        """Sessions with ``config``'s tier, TTL and budget (a share of that tier)."""
        device = config.session_tier == "device"
        tier_tokens = config.device_tokens if device else config.host_tokens
        budget = int(config.session_budget_fraction * tier_tokens)
        return cls(
            tree,
            budget,
            config.session_ttl_s,
            config.session_tier,
            clock,
            write_backup,
            unlock,
            int(config.tenant_share * budget),
        )

    def reset(self) -> None:
        """Forget every session (the tree they pointed into is gone)."""
        self.held: OrderedDict[str, Held] = OrderedDict()
        self.held_tokens = 0
        self.by_tenant: dict[str, int] = {}  # tokens held per namespace

    def keep(self, session_id: str, node: TreeNode, ttl_s: float | None = None) -> str | None:
        """The session now holds ``node`` (for ``ttl_s``, the configured TTL by
        default), taking over one lock on it that the caller passes on
        (``Admission.end``), in place of what it held before. Returns ``None``, or
        why it holds nothing (the lock is dropped then)."""
        check_session_id(session_id)
        self.end(session_id)
        if node is self.tree.root:
            return "no whole page to keep"
        tokens, tenant, unit = self.size(node), self.tenant(node), self.unit
        if tokens > self.tenant_budget:
            self.unlock(node)
            if tokens > self.budget:
                return f"a session of {tokens} {unit} exceeds the session budget of {self.budget}"
            return (
                f"a session of {tokens} {unit} exceeds tenant {tenant!r}'s session budget of "
                f"{self.tenant_budget} (cache.tenant_share)"
            )
        while self.by_tenant.get(tenant, 0) + tokens > self.tenant_budget:
            # The tenant's own least recently kept, not another tenant's.
            self.end(next(s for s, h in self.held.items() if h.tenant == tenant))
        while self.held_tokens + tokens > self.budget:
            self.end(next(iter(self.held)))  # the least recently kept
        if self.tier == "host":
            node.host_ref += 1
            if node.host_value is None:
                self.write_backup(node)
            self.unlock(node)
        ttl = self.ttl_s if ttl_s is None else ttl_s
        self.held[session_id] = Held(node, tokens, self.clock() + ttl, tenant)
        self.held_tokens += tokens
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + tokens
        return None

    def end(self, session_id: str) -> bool:
        """Drop what the session holds; ``False`` if it held nothing."""
        held = self.held.pop(session_id, None)
        if held is None:
            return False
        self.held_tokens -= held.tokens
        left = self.by_tenant[held.tenant] - held.tokens
        if left:
            self.by_tenant[held.tenant] = left
        else:
            del self.by_tenant[held.tenant]
        if self.tier == "host":
            held.node.host_ref -= 1
        else:
            self.unlock(held.node)
        return True

    def expire(self) -> int:
        """End every session whose TTL passed; returns how many."""
        now = self.clock()
        gone = [sid for sid, held in self.held.items() if held.expires_at <= now]
        for sid in gone:
            self.end(sid)
        return len(gone)

    def next_expiry(self) -> float | None:
        """When the first session's TTL passes (``clock`` time), if any is held."""
        return min((h.expires_at for h in self.held.values()), default=None)

    def host_held(self) -> list[TreeNode]:
        """Nodes that sessions protect in L2 (one host protection each)."""
        return [h.node for h in self.held.values()] if self.tier == "host" else []


def check_session_id(session_id: object) -> str:
    if not (isinstance(session_id, str) and 0 < len(session_id) <= MAX_SESSION_ID_CHARS):
        raise InvalidInput(
            f"session id {session_id!r} is refused: allowed is a non-empty str of at most "
            f"{MAX_SESSION_ID_CHARS} characters"
        )
    return session_id
