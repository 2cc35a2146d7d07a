"""Where a request's KV sits in L1: the longest cached prefix of a key (for a
hybrid model, the deepest end every component can serve), L1 pages leased for
new KV, placing them in the tree (``insert``, ``extend``), and the locks that
keep a matched path in L1. ``HiCache`` builds one ``Placement``; its callers use
it directly (``cache.placement``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fabric.cache.allocator import PagedAllocator, Pages, as_pages
from fabric.cache.components import Components, PartFill
from fabric.cache.controller import Controller
from fabric.cache.events import EventLog, Medium
from fabric.cache.evictions import DeviceEvictions
from fabric.cache.keys import TokenKey
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree
from fabric.cache.results import InsertResult, MatchResult
from fabric.cache.writes import Writes
from fabric.errors import InvalidInput


def check_key(key: TokenKey, page_size: int) -> None:
    if not isinstance(key, TokenKey):
        raise InvalidInput(f"expected a TokenKey, got {type(key).__name__}")
    if key.page_size != page_size:
        raise InvalidInput(f"key page_size {key.page_size} != cache page_size {page_size}")


def take_pages(pool: PagedAllocator, num_tokens: int, evict: Callable[[int], int]) -> Pages | None:
    """``num_tokens`` (whole pages) from ``pool``, evicting that tier when short;
    ``None`` when not enough can be freed now."""
    num_pages = num_tokens // pool.page_size
    if num_pages > pool.num_pages:
        return None  # no eviction can make room
    got = pool.alloc(num_pages)
    if got is None:
        evict((num_pages - pool.available_pages) * pool.page_size)
        got = pool.alloc(num_pages)
    return got


class Room:
    """``num_tokens`` of whole pages from one tier's pool (``"device"`` or ``"host"``
    of the controller, looked up at each call), evicting that tier when short:
    what the writes (L2) and the load-backs (L1) allocate with."""

    def __init__(self, ctl: Controller, tier: str, evict: Callable[[int], int]) -> None:
        self.ctl = ctl
        self.tier = tier
        self.evict = evict

    def __call__(self, num_tokens: int) -> Pages | None:
        return take_pages(getattr(self.ctl, self.tier), num_tokens, self.evict)


class Placement:
    """Matching and L1 placement for one cache. Its collaborators: the tree, the
    controller (whose L1 pool leases pages), a hybrid model's components, the
    event log, the writes (hits count toward write-through), the L1 evictions
    (which make room) and the clock. ``leased``: L1 pages handed out by
    ``alloc_device`` and not yet the tree's or freed."""

    def __init__(
        self,
        tree: RadixTree,
        ctl: Controller,
        parts: Components | None,
        events: EventLog,
        writes: Writes,
        evictions: DeviceEvictions,
        clock: Callable[[], float],
    ) -> None:
        self.tree = tree
        self.ctl = ctl
        self.parts = parts
        self.events = events
        self.writes = writes
        self.evict = evictions.evict
        self.clock = clock
        self.page_size = tree.page_size
        self.leased: set[int] = set()
        self.last_path: list[TreeNode] = []  # a hybrid model's last match path

    def match_prefix(self, key: TokenKey, held: TreeNode | None = None) -> MatchResult:
        """The longest cached prefix of ``key`` over L1 and L2. Splits the node where
        the match ends inside it; refreshes access times and pin TTLs.

        For a hybrid model, the longest prefix on device that every component can
        serve (``Components.valid_end``), or at least up to ``held`` (a request's
        own locked pages: the engine holds its state there)."""
        check_key(key, self.page_size)
        now = self.clock()
        tree = self.tree
        path = tree.descend(tree.root, key.namespace, key.data, 0, len(key.data), now)
        if self.parts is not None:
            return self._match_parts(path, now, held)
        device_pages = as_pages()
        last_device = last_host = tree.root
        host_pages = 0
        for node in path:
            if node.pin_expiry and node.pin_expiry >= now:
                node.pin_expiry = now + node.pin_ttl
            if node.device_value is not None:
                device_pages.extend(node.device_value)
                last_device = node
            else:
                host_pages += len(node.host_value)  # type: ignore[arg-type]
            if node.host_value is not None and node.write_op is None:
                last_host = node
        return MatchResult(
            device_pages,
            len(device_pages) * self.page_size,
            host_pages * self.page_size,
            last_device,
            last_host,
        )

    def _match_parts(self, path: list[TreeNode], now: float, held: TreeNode | None) -> MatchResult:
        # The deepest valid end on device (the served prefix, at least ``held``),
        # and the deepest valid end at all: when that one is deeper it ends an
        # L1-evicted chain whose L2 copies (components too) a load-back brings.
        parts, tree = self.parts, self.tree
        assert parts is not None
        self.last_path = path  # for ``Components.count_match``
        end = len(path)
        while end and path[end - 1] is not held and not parts.valid_end(path[end - 1], tree.pages):
            end -= 1
        deepest = path[end - 1] if end else tree.root
        device = 0
        for i in range(end):
            if path[i].device_value is None:
                break
            device = i + 1
        while (
            device
            and path[device - 1] is not held
            and not parts.valid_end(path[device - 1], tree.pages)
        ):
            device -= 1
        if end < len(path):
            parts.stats.truncated_matches += 1
        pages = as_pages()
        for node in path[:device]:
            pages.extend(node.device_value)  # type: ignore[arg-type]
            if node.pin_expiry and node.pin_expiry >= now:
                node.pin_expiry = now + node.pin_ttl
        last = path[device - 1] if device else tree.root
        host_pages = sum(len(n.host_value) for n in path[device:end] if n.device_value is None)  # type: ignore[arg-type]
        last_host = deepest if host_pages else tree.root
        if not host_pages:
            for node in path[:device]:
                if node.host_value is not None and node.write_op is None:
                    last_host = node
        return MatchResult(
            pages, len(pages) * self.page_size, host_pages * self.page_size, last, last_host
        )

    def fill_parts(self, node: TreeNode, stop: TreeNode | None = None) -> PartFill | None:
        """For a hybrid model (``None`` for full attention only), give every node end
        from below ``stop`` (an ancestor of ``node``; default: ``node``'s parent) down
        to ``node`` the components it lacks: what the KV fill computing through
        those ends must write. Ends where the tree branches (a split) get them too,
        so a later request that stops there is served."""
        if self.parts is None:
            return None
        tree, parts = self.tree, self.parts
        stop = node.parent if stop is None else stop
        ends, x = [], node
        end = tree.depth_pages(node)
        while x is not stop and x is not tree.root:
            ends.append((x, end, False))
            start = end - tree.pages(x)
            for cut in parts.checkpoints(start, end):  # split at each, deepest first
                x = tree.split(x, (cut - start) * tree.page_bytes)
                ends.append((x, cut, True))
            end = start
            x = x.parent  # type: ignore[assignment]
        out = PartFill()
        for x, end, checkpoint in reversed(ends):  # ancestors first: a deeper end spares them
            parts.fill(x, end, tree.pages, out, checkpoint)
            self.writes.on_parts(x)
        return out

    def insert(self, key: TokenKey, device_pages: Sequence[int], priority: int = 0) -> InsertResult:
        """Cache ``key`` with KV in ``device_pages`` (one L1 page per key page).

        Pages past the device-resident prefix must be leased from
        ``alloc_device``; they become the tree's (also over L1-evicted nodes,
        which get them as their new device value). Leased pages given for the
        already-cached prefix are duplicates and are freed here. Priority is
        max-propagated along the path. Raises ``InvalidInput`` and changes
        nothing on a length mismatch or a page that is not leased.
        """
        check_key(key, self.page_size)
        if not isinstance(priority, int):
            raise InvalidInput(f"priority {priority!r} is refused: allowed is an int")
        given = as_pages(device_pages)
        if len(given) != key.num_pages:
            raise InvalidInput(
                f"insert of {key.num_pages} pages got {len(given)} device pages: lengths differ"
            )
        cached = self.tree.peek_device_pages(key.namespace, key.data)
        fresh = set(given[cached:])
        if len(fresh) != len(given) - cached or not fresh <= self.leased:
            raise InvalidInput(
                f"insert pages {sorted(fresh - self.leased) or 'repeated'} are not distinct "
                "pages leased by alloc_device"
            )
        last = self._place(key, self.tree.root, 0, given, priority)
        if self.parts is not None:
            self.fill_parts(last)
        duplicates = tuple(sorted(self.leased.intersection(given[:cached])))
        self.leased -= fresh
        if duplicates:
            self.free_device(duplicates)
        return InsertResult(cached * self.page_size, duplicates, last)

    def extend(
        self, key: TokenKey, match: MatchResult, priority: int = 0, first: int | None = None
    ) -> tuple[TreeNode, Pages] | None:
        """Allocate L1 pages for what ``match`` lacks of ``key`` (evicting if short) and
        insert them: ``alloc_device`` and ``insert`` in one step, for the request
        lifecycle (``fabric.cache.admission``). ``match`` must be current, its last
        device node locked. ``first``: a page leased from ``alloc_device`` to be
        the first new page (it stops being leased). Returns the last node and the
        new pages (their KV is still to be computed), or ``None`` when L1 has no
        room now."""
        need = key.num_tokens - match.device_tokens - (0 if first is None else self.page_size)
        new = take_pages(self.ctl.device, need, self.evict)
        if new is None:
            return None
        if first is not None:
            self.leased.remove(first)
            new = as_pages((first,)) + new
        # The matched device path is locked, so unchanged since the match: count
        # its hits from the top without walking the key again.
        path, node = [], match.last_device_node
        while node is not self.tree.root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        for node in reversed(path):
            node.priority = max(node.priority, priority)
            self.writes.on_hit(node)
        start = match.device_tokens // self.page_size
        surplus = as_pages()
        last = self._place(key, match.last_device_node, start, new, priority, surplus)
        if surplus:
            # A hybrid match stopped short of pages already on device: they stay the
            # tree's (the fill recomputes their KV in place); ours for them go back.
            self.ctl.device.free(surplus)
            chain, node = [], last
            while node is not match.last_device_node:
                chain.append(node.device_value)
                node = node.parent  # type: ignore[assignment]
            new = as_pages()
            for value in reversed(chain):
                new.extend(value)
        return last, new

    def _place(
        self,
        key: TokenKey,
        top: TreeNode,
        start: int,
        given: Pages,
        priority: int,
        surplus: Pages | None = None,
    ) -> TreeNode:
        # Below ``top`` (which ends page ``start`` of the key), nodes without a device
        # value (L1-evicted) take their pages from ``given`` (for the key's pages
        # from ``start`` on); the rest of the key becomes a new leaf. Nodes already on
        # device (below a hybrid match's end only) keep theirs; the pages given for
        # them go to ``surplus``.
        tree, now = self.tree, self.clock()
        pb, ns, data = tree.page_bytes, key.namespace, key.data
        offset, last = start, top
        for node in tree.descend(top, ns, data, start * pb, len(data), now):
            node.priority = max(node.priority, priority)
            n = tree.pages(node)
            if node.device_value is None:
                tree.set_device(node, given[offset - start : offset - start + n])
                self.events.stored(node, Medium.DEVICE)
            else:
                if surplus is not None:
                    assert self.parts is not None, "L1 residency is prefix-closed"
                    surplus.extend(given[offset - start : offset - start + n])
                self.writes.on_hit(node)
            offset += n
            last = node
        if offset < key.num_pages:
            last = tree.attach(last, ns, data[offset * pb :], now, priority)
            last.page_hashes = key.known_hashes(offset)  # hashed once per request
            tree.set_device(last, given if offset == start else given[offset - start :])
            self.events.stored(last, Medium.DEVICE)
            self.writes.on_hit(last)
        return last

    def alloc_device(self, num_tokens: int) -> Pages | None:
        """Lease L1 pages for ``num_tokens`` of new KV, evicting L1 if short. ``None``
        when not enough can be freed now (write-backs may free more later)."""
        if not isinstance(num_tokens, int) or num_tokens < 0 or num_tokens % self.page_size:
            raise InvalidInput(
                f"alloc_device({num_tokens!r}) is refused: allowed is a multiple of page_size "
                f"({self.page_size}) >= 0"
            )
        leased = take_pages(self.ctl.device, num_tokens, self.evict)
        if leased is not None:
            self.leased.update(leased)
        return leased

    def free_device(self, device_pages: Sequence[int]) -> None:
        """Return leased L1 pages; ``InvalidInput`` (nothing freed) for any page not leased."""
        freed = tuple(device_pages)
        bad = set(freed) - self.leased
        if bad or len(set(freed)) != len(freed):
            raise InvalidInput(
                f"free_device of pages {sorted(bad) or 'repeated'} that are not leased"
            )
        self.ctl.device.free(freed)
        self.leased.difference_update(freed)

    # -- locks -------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its path from L1 eviction (the node must be on device),
        and for a hybrid model what a match ending there needs of the other
        components."""
        if node is not self.tree.root and node.device_value is None:
            raise InvalidInput(f"cannot lock {node}: it is not on device")
        self.tree.inc_lock_ref(node)
        if self.parts is not None:
            self.parts.lock(node, self.tree.pages)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        self.tree.dec_lock_ref(node)
        if self.parts is not None:
            self.parts.unlock(node, self.tree.pages)
