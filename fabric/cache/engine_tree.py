"""What the coordinator keeps of engines' pages, and how it answers them: the
policies over the tree of ``fabric.cache.engine_index``, as the fabric's own
pages have them (``fabric.cache.evictions``, ``fabric.cache.writes``).

- **Eviction**: leaves first, in the configured eviction policy's order, per
  place against its capacity in bytes, and for the whole tree against
  ``index_pages``. A node some lookup's lease holds (the lease is a lock on its
  path, as a request's on the tree) is passed over until the lease is
  released or expires, and what it kept past a cap leaves as soon as it ends.
  Each eviction is an ``Order`` for the ranks that hold the page there: delete
  it. A lookup makes room in its node's L2 for the pages its request will keep
  there, before they come (never of its own match).
- **Write policy** (L2 -> L3, as the fabric's own L1 -> L2): under
  ``write_through`` an engine stores each page in its node's L2 and in L3 at
  once; under ``write_back`` in its node's L2 only, and a page the tree evicts
  from L2 that L3 lacks is moved there first (``MOVE``); under
  ``write_through_selective`` in its node's L2, and a page found by
  ``hit_threshold`` lookups is copied to L3 (``BACKUP``).
- **Lookups** count the leading pages whole in L3 or in the asking node's L2.
  Under the ``best_effort`` prefetch stop policy (``l2_only``) they count only
  the asking node's L2, and the pages after those that only L3 holds are
  prefetched into that L2 (``PREFETCH``), not waited for: the next request of
  the prefix finds them on the node. (Under ``timeout`` and ``wait_complete``
  the request waits for its own L3 reads, which go to the node's L2 as well.)
- **Holds**: sessions and pins (``fabric.cache.engine_holds``) lock a prefix
  in every place it is in until their TTL passes.

Orders wait in ``orders`` until taken (``take_orders``). Nothing here imports Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fabric.cache.engine_holds import EngineHolds, HoldOptions
from fabric.cache.engine_index import MAX_GONE, EngineIndex
from fabric.cache.engine_input import (
    L2_AT,
    L3,
    MAX_LEASES,
    PageName,
    StoredRun,
    check_chains,
    check_group,
    check_leases,
    check_needs,
)
from fabric.cache.engine_places import BACKUP, DELETE, MOVE, PREFETCH, Order, group_of, hit_point
from fabric.cache.events import KVEvent
from fabric.cache.node import TreeNode
from fabric.errors import InvalidInput
from policies import get_write_policy

# The share of a node's L2 regions the tree fills (see ``EngineTree.declare``).
L2_LOAD = 0.5
# A prefetch not seen landed within this long may be ordered again.
PREFETCH_RETRY_S = 10.0


class EngineTree(EngineIndex):
    def __init__(
        self,
        eviction_policy: str = "lru",
        index_pages: int = 1 << 20,
        capacity: dict[str, int] | None = None,
        write_policy: str = "write_through",
        holds: HoldOptions | None = None,
    ) -> None:
        """``capacity``: bytes per place (``L3``, a node's L2, or ``L2_AT`` for
        every node's); a place not named, or 0, is capped by ``index_pages`` only.
        ``holds``: the sessions' and pins' budgets and TTL."""
        self.write = get_write_policy(write_policy)
        self.hold_options = holds or HoldOptions(l3_bytes=(capacity or {}).get(L3, 0))
        super().__init__(eviction_policy, index_pages, capacity)

    def clear(self) -> None:
        """Forget every page and every lease (L3 was cleared)."""
        super().clear()
        self._leases: OrderedDict[str, tuple[float, list[TreeNode]]] = OrderedDict()
        self._backing: set[int] = set()  # nodes a ``BACKUP`` was asked for
        # (group, first page, place) prefetched -> when it may be ordered again
        self._fetching: dict[tuple[str, bytes, str], float] = {}
        self._regions: dict[str, dict[str, int]] = {}  # place -> tag -> region bytes
        self.events: list[KVEvent] = []  # of evictions outside reports, for ``take_events``
        self._let_go = False  # a lease or hold ended since the last eviction
        self.holds = EngineHolds(
            self.tree, self.hold_options, self._walk, self._unhold, self._page_bytes
        )

    @property
    def leased(self) -> int:
        return len(self._leases)

    def declare(self, place: str, tag: str, region_bytes: int) -> None:
        """An engine of ``tag`` on ``place``'s node keeps its pages there in regions
        of ``region_bytes`` in all (its ranks' ``l2_bytes``): the place holds
        ``L2_LOAD`` of what its engines' regions hold (engines of one tag share
        their regions). A region is set-associative: kept under that load, a
        set is rarely full, so it seldom replaces a page the tree counts."""
        if not place.startswith(L2_AT) or region_bytes <= 0:
            return
        regions = self._regions.setdefault(place, {})
        if regions.get(tag) != region_bytes:
            regions[tag] = region_bytes
            self.places.capacity[place] = int(sum(regions.values()) * L2_LOAD)

    def take_orders(self) -> list[Order]:
        """The orders queued since the last call, oldest first."""
        orders, self.orders = self.orders, []
        return orders

    # -- lookups and leases --------------------------------------------------------------

    def lookup(
        self,
        tag: str,
        world: int,
        chains: Sequence[Sequence[bytes]],
        leases: Sequence[str] | None = None,
        lease_s: float = 0.0,
        now: float = 0.0,
        place: str = "",
        l2_only: bool = False,
        final: list[bool] | None = None,
        needs: Sequence[tuple[str, int]] = (),
    ) -> list[int]:
        """Per chain (one request's page hashes, in order): how many leading pages
        are whole in L3 or in ``place`` (the asking node's L2) — with ``l2_only``,
        in ``place`` only, the pages after them that L3 holds whole prefetched into
        ``place``. The pages matched are used now; with ``leases`` (a name per
        chain), each chain's match is leased under its name until ``release`` or
        ``now + lease_s`` (a lease the name held before ends: a name leases once).
        ``final`` gets, per chain, whether the page after the match is one the
        tree evicted from L3 (nothing beyond is to be looked for in the store).

        ``needs``: a hybrid engine's other component groups (``hit_point``)."""
        check_group(tag, world)
        self.expire(now)
        if leases is not None:
            check_leases(leases, chains, lease_s)
        check_chains(chains)
        check_needs(needs, world)
        full = (1 << world) - 1
        place = place if place.startswith(L2_AT) else ""  # (a replica's blocks: vLLM's)
        out = []
        for i, chain in enumerate(chains):
            in_l2 = self.stats.l2_hit_pages
            n, node = self._match(tag, world, chain, full, place, now, l2_only and bool(place))
            held: list[TreeNode] = [node] if node is not None else []
            if needs and n:  # a hybrid engine: its components' hit point, and their nodes
                n, parts = hit_point(self.where, world, chain, n, needs, full, place, l2_only, now)
                held = parts + held if n else []
            self.stats.lookups += 1
            self.stats.lookup_pages += len(chain)
            self.stats.hit_pages += n
            out.append(n)
            if final is not None:
                final.append(n < len(chain) and (tag, world, chain[n]) in self.gone)
            if leases is not None:  # a name leases once: a new lookup under it replaces it
                self._lease(leases[i], held, now, lease_s)
            if place:  # what the request will keep in its node's L2 needs room there
                in_l2 = self.stats.l2_hit_pages - in_l2
                self._make_room(place, (len(chain) - in_l2) * self._group_bytes(tag, world), node)
        self._evict_let_go()
        return out

    def _make_room(self, place: str, need: int, match: TreeNode | None) -> None:
        """Evict from ``place`` until ``need`` more bytes fit: the pages a request
        will store there, before they come (a region refuses a page when its set is
        full of held ones); never the request's ``match``."""
        if need <= 0 or not 0 < self.places.cap(place) < self.places.used.get(place, 0) + need:
            return
        if match is not None:
            self.places.lock(match, +1)
        self._evict_place(place, need, self.events)
        if match is not None:
            self.places.lock(match, -1)

    def take_events(self) -> list[KVEvent]:
        """The events of evictions made outside a report: room a lookup made for its
        request's pages, and what leases and holds let go of."""
        events, self.events = self.events, []
        return events

    def _match(
        self,
        tag: str,
        world: int,
        chain: Sequence[bytes],
        full: int,
        place: str,
        now: float,
        l2_only: bool = False,
    ) -> tuple[int, TreeNode | None]:
        """The leading pages whole in L3 or ``place`` (``l2_only``: in ``place``,
        the L3 pages after them prefetched), and the node of the last."""
        matched, last, i = 0, None, 0
        node = self.where.get((tag, world, chain[0])) if chain else None
        at = node.page_hashes.index(chain[0]) if node is not None else 0  # type: ignore[union-attr]
        counting = True
        while node is not None:
            places = node.places or {}
            in_l2 = places.get(place, 0) == full
            if not in_l2 and places.get(L3, 0) != full:
                break
            hashes = node.page_hashes
            assert hashes is not None
            k = 0
            while at + k < len(hashes) and i + k < len(chain) and hashes[at + k] == chain[i + k]:
                k += 1
            if k and at + k < len(hashes):  # the match ends inside: it is used, the rest not
                node = self._split(node, at + k)
            node.last_access = now
            node.hit_count += 1
            if l2_only and not in_l2:
                counting = False
                self._prefetch(node, place, full, now)
            if counting:
                matched, last = matched + k, node
                self.stats.l2_hit_pages += k if in_l2 else 0
                self._maybe_back_up(node, full)
            i += k
            if at + k < len(node.page_hashes or ()) or i == len(chain):
                break
            node, at = self.where.get((tag, world, chain[i])), 0
        return matched, last

    def _prefetch(self, node: TreeNode, place: str, full: int, now: float) -> None:
        """Order ``node``'s pages read from L3 into ``place`` (once while in flight)."""
        key = (node.namespace, (node.page_hashes or [b""])[0], place)  # (kept over splits)
        if self._fetching.get(key, -1.0) > now:
            return
        if len(self._fetching) >= MAX_LEASES:
            self._fetching = {k: t for k, t in self._fetching.items() if t > now}
        self._fetching[key] = now + PREFETCH_RETRY_S
        self.orders.append(self._order(node, place, full, PREFETCH))
        self.stats.prefetch_pages += len(node.page_hashes or ())

    def _lease(self, name: str, nodes: list[TreeNode], now: float, lease_s: float) -> None:
        if name in self._leases:
            self._end(name)
        if not nodes or lease_s <= 0:
            return
        self._leases[name] = (now + lease_s, nodes)
        for node in nodes:
            self.places.lock(node, +1)
        self.stats.leases += 1
        while len(self._leases) > MAX_LEASES:
            self._end(next(iter(self._leases)))
            self.stats.leases_expired += 1

    def release(self, names: Sequence[str]) -> int:
        """End the leases ``names`` (unknown or ended ones are skipped); how many."""
        if not isinstance(names, (list, tuple)) or len(names) > MAX_LEASES:
            raise InvalidInput(
                f"lease names are refused: allowed is a list of at most {MAX_LEASES}"
            )
        ended = 0
        for name in names:
            if isinstance(name, str) and name in self._leases:
                self._end(name)
                ended += 1
        self.stats.leases_released += ended
        self._evict_let_go()
        return ended

    def expire(self, now: float) -> int:
        """End the leases whose time is up at ``now`` (and the holds); how many leases."""
        self.holds.expire(now)
        expired = [name for name, (until, _) in self._leases.items() if until <= now]
        for name in expired:
            self._end(name)
        self.stats.leases_expired += len(expired)
        return len(expired)

    def _end(self, name: str) -> None:
        _, nodes = self._leases.pop(name)
        for node in nodes:
            self._unhold(node)

    def _evict_let_go(self) -> None:
        """What a place holds past its capacity once leases and holds let it go
        leaves now (its events for ``take_events``), not at the next report."""
        if self._let_go:
            self._let_go = False
            self._evict(self.events)

    # -- reports, eviction, write policy ---------------------------------------------------

    def report(
        self,
        tag: str,
        world: int,
        reports: dict[int, Sequence[StoredRun]],
        now: float = 0.0,
        names: Sequence[PageName] = (),
    ) -> tuple[list[KVEvent], list[Order]]:
        """Record, per rank, the pages it stored (used ``now``), and the engine's
        ``names`` of pages; the events of the pages this made whole somewhere or
        evicted, and the orders queued since the last take (this report's
        evictions among them)."""
        events = self.record(tag, world, reports, now, names)
        if self.l1_heard:
            events += self.forget_silent_l1(now)
        self.holds.expire(now)
        if self.holds.awaiting:
            for runs in reports.values():
                for run in runs:
                    self.holds.reported(tag, world, run.hashes, now)
        self._let_go = False
        self._evict(events)
        return events, self.take_orders()

    # -- sessions and pins -----------------------------------------------------------------

    def hold(
        self,
        tag: str,
        world: int,
        chain: Sequence[bytes],
        name: str,
        kind: str,
        ttl_s: float | None = None,
        now: float = 0.0,
    ) -> str | None:
        """Keep ``chain``'s pages (one prefix) in every place they are in, under
        ``name`` of ``kind`` (``engine_holds``); ``None``, or why nothing is held."""
        check_group(tag, world)
        check_chains([chain])
        why = self.holds.hold(tag, world, chain, name, kind, ttl_s, now)
        self._evict_let_go()  # (a hold this one took over, or one expired)
        return why

    def _walk(self, tag: str, world: int, chain: Sequence[bytes]) -> tuple[TreeNode | None, int]:
        """The node of the deepest page of ``chain`` the tree knows on its path (cut
        to end there), and how many pages that is."""
        node = self.where.get((tag, world, chain[0])) if chain else None
        if node is None or (node.page_hashes or [None])[0] != chain[0]:
            return None, 0
        last, i = None, 0
        while node is not None:
            hashes = node.page_hashes or []
            k = 0
            while k < len(hashes) and i + k < len(chain) and hashes[k] == chain[i + k]:
                k += 1
            if k < len(hashes):  # the chain ends or leaves inside: held up to there
                node = self._split(node, k) if k else None
                if node is not None:
                    last, i = node, i + k
                break
            last, i = node, i + k
            if i == len(chain):
                break
            node = self.where.get((tag, world, chain[i]))
            if node is not None and node.parent is not last:
                break
        return last, i

    def _unhold(self, node: TreeNode) -> None:
        self.places.lock(node, -1)
        self._prune(node)
        self._let_go = True

    def _page_bytes(self, node: TreeNode) -> int:
        return self._group_bytes(*group_of(node))

    def _group_bytes(self, tag: str, world: int) -> int:
        """A whole page's bytes, every rank's shard (0 before any is reported)."""
        return sum(self.ranks.get((tag, world), {}).values())

    def _evict(self, events: list[KVEvent]) -> None:
        """Leaves leave each place over its capacity, then the tree's pages over
        ``index_pages``, in the policy's order, leased ones passed over."""
        for place in self.places.over():
            self._evict_place(place, 0, events)
        for node in self.places.ends_victims(lambda: len(self.where) > self.index_pages):
            for place in list(node.places or ()):
                events.extend(self._leave(node, place, DELETE))
                self._count(place, node)
            self._prune(node)

    def _evict_place(self, place: str, room: int, events: list[KVEvent]) -> None:
        """Leaves leave ``place`` until it holds at most its capacity less ``room``
        bytes."""
        for node in self.places.victims(place, room):
            node = self._tail(node, place, room)
            if place == L3:
                self._gone(node)
            events.extend(self._leave(node, place, self._eviction(node, place)))
            self._count(place, node)
            self._prune(node)

    def _gone(self, node: TreeNode) -> None:
        """``node`` leaves L3 by the tree's choice: a lookup stopping at it is final."""
        group = group_of(node)
        for h in node.page_hashes or ():
            self.gone[(*group, h)] = None
            self.gone.move_to_end((*group, h))
        while len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)

    def _tail(self, node: TreeNode, place: str, room: int = 0) -> TreeNode:
        """The pages of the leaf ``node`` that must leave ``place`` to bring it within
        its capacity: its last ones only (cut off), its first kept — a node is
        the pages one report stored, and a prompt's many pages need not all go
        for one page's room."""
        pages = node.page_hashes or []
        ranks = self.ranks.get(group_of(node), {})
        mask = (node.places or {}).get(place, 0)
        per_page = sum(size for rank, size in ranks.items() if mask >> rank & 1)
        over = self.places.used.get(place, 0) + room - self.places.cap(place)
        if per_page <= 0 or len(pages) < 2 or over <= 0:
            return node
        need = -(-over // per_page)
        if need >= len(pages):
            return node
        self._split(node, len(pages) - need)  # ``node`` keeps the last ``need`` pages
        return node

    def _eviction(self, node: TreeNode, place: str) -> str:
        """What a node leaving ``place`` asks of its ranks there: under write-back, a
        node's L2 shards that L3 lacks go there first."""
        if place == L3 or not self.write.write_back:
            return DELETE
        places = node.places or {}
        return DELETE if places.get(place, 0) & ~places.get(L3, 0) == 0 else MOVE

    def _maybe_back_up(self, node: TreeNode, full: int) -> None:
        """Under ``write_through_selective``: a node hit ``hit_threshold`` times that L3
        lacks is copied there from a node's L2 that has it whole."""
        threshold = self.write.hit_threshold
        if threshold is None or threshold <= 1 or node.hit_count < threshold:
            return
        places = node.places or {}
        if places.get(L3, 0) == full or node.id in self._backing:
            return
        source = next((p for p, m in places.items() if p.startswith(L2_AT) and m == full), None)
        if source is not None:
            self._backing.add(node.id)
            self.orders.append(self._order(node, source, full, BACKUP))

    def _prune(self, node: TreeNode) -> None:
        self._backing.discard(node.id)
        super()._prune(node)

    def _leave(self, node: TreeNode, place: str, kind: str | None = None) -> list[KVEvent]:
        if place == L3:
            self._backing.discard(node.id)  # out of L3: a later hit may copy it again
        return super()._leave(node, place, kind)
