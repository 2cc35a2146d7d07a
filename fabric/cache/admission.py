"""The request lifecycle over one cache — the one the coordinator serves with, the
in-process replay runs and the benches measure.

A request holds its KV in a ``RequestKV`` from ``begin`` to ``release``:

- ``start_prefetch`` / ``check_prefetch``, when L3 may hold more than L1 and L2;
- ``prefill`` up to a token count — the whole prompt at once, or chunk by chunk:
  match, load the L2 tail back, make room in L1 and insert the new whole pages,
  the request's lock moving to the new last node, so a request sharing the
  prefix hits the chunks already placed. Tokens past the last whole page go to
  a page of the request's own, outside the tree (the reference keeps a
  request's unaligned tail the same way: it is cached only once a page is full);
- ``append`` (decode): generated tokens join the request; a page they fill
  enters the tree, so the next turn hits through the answer;
- ``finish`` / ``release`` (finish or abort): the request's own page is freed
  and its lock dropped — or kept by a session for its next turn, or handed on
  with ``end`` (a lease);
- pins and sessions, the holds that outlive a request.

Each step returns a ``Fill``: the L1 pages whose KV the caller has the ranks
compute. ``None`` from a step means L1 has no room now and nothing changed.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from fabric.cache.allocator import Pages, as_pages
from fabric.cache.components import PartFill
from fabric.cache.hicache import HiCache
from fabric.cache.keys import TOKEN_BYTES, TokenKey, check_namespace
from fabric.cache.node import TreeNode
from fabric.cache.results import PinResult
from fabric.cache.sessions import check_session_id
from fabric.errors import InvalidInput


@dataclass(eq=False, slots=True)
class RequestKV:
    """The KV one request holds in the cache.

    ``tokens``: all its token ids so far, packed (``fabric.cache.keys``): the
    prompt, then appended output. KV is placed for the first ``filled`` of them:
    whole pages in the tree (``pages``, ending at ``node``, which this request
    keeps locked) and past them, fewer than a page of tokens in ``tail_page``, an
    L1 page leased to the request alone. Hits and computed tokens add up over
    every step; ``prefetched`` counts L2 tokens its prefetch brought from L3 that
    no step has loaded back yet."""

    namespace: str
    priority: int
    page_size: int
    tokens: bytes | bytearray
    node: TreeNode
    pages: Pages
    key: TokenKey | None = None  # the prompt's key while ``tokens`` still ends with it
    tail_page: int | None = None
    filled: int = 0
    prefetched: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    computed: int = 0
    ended: bool = False
    # A hybrid model's components of the prefix ending at ``node`` as of the last
    # fill (``Components.held``): all written by that fill's commands or earlier.
    parts_held: tuple = ((), ())

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def cached_tokens(self) -> int:
        """Tokens of whole pages in the tree that this request holds."""
        return len(self.pages) * self.page_size

    @property
    def device_pages(self) -> Pages:
        """L1 pages of every filled token, the request's own tail page last."""
        if self.tail_page is None:
            return self.pages
        return self.pages + as_pages((self.tail_page,))


@dataclass(slots=True)
class Fill:
    """What a step asks the ranks to compute: KV for token positions
    ``[first_new, end)`` into ``pages``, which cover ``[start, end)`` from the
    page-aligned ``start`` (KV before ``first_new`` in the first page is there
    already); no pages when nothing is new. ``prefix_node`` ends the cached pages before ``start``: their chain
    hash is where the new pages' hashes continue. ``parts``: for a hybrid model,
    the other components to write (sliding-window KV of the window before the
    last whole page's end, the mamba state there), else ``None``."""

    start: int
    first_new: int
    end: int
    pages: Pages
    prefix_node: TreeNode
    parts: PartFill | None = None

    @property
    def new_tokens(self) -> int:
        return self.end - self.first_new


class Admission:
    def __init__(self, cache: HiCache) -> None:
        self.cache = cache

    # -- L3 ------------------------------------------------------------------------

    def start_prefetch(self, req_id: Hashable, key: TokenKey) -> bool:
        """Start fetching from L3 what L1 and L2 lack of ``key``; ``False`` when not
        worth it (no storage, below the threshold, rate limited)."""
        l3 = self.cache.l3
        if not l3.attached:
            return False
        return (
            l3.start_prefetch(req_id, key, self.cache.placement.match_prefix(key)).op_id is not None
        )

    def check_prefetch(self, req_id: Hashable) -> int | None:
        """``None`` while the prefetch should be waited for; else the tokens it added
        to L2 (0 for none)."""
        return self.cache.l3.check_prefetch(req_id)

    # -- the steps -------------------------------------------------------------------

    def begin(
        self,
        tokens: bytes | TokenKey,
        namespace: str = "default",
        priority: int = 0,
        prefetched: int = 0,
        key: TokenKey | None = None,
    ) -> RequestKV:
        """A request with packed ``tokens`` — or a prompt's key, whose unaligned tail
        it lacks — and nothing placed yet. ``key``: the key of ``tokens``' whole
        pages when the caller has one (the page hashes it holds are reused).
        Changes nothing in the cache."""
        if isinstance(tokens, TokenKey):
            key, data = tokens, tokens.data
        else:
            data = tokens
        if not isinstance(data, bytes) or len(data) % TOKEN_BYTES:
            raise InvalidInput("tokens must be packed uint32 token ids (bytes)")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidInput(f"priority {priority!r} is refused: allowed is an int")
        ps = self.cache.page_size
        if (
            key is not None
            and data is not key.data
            and (
                not isinstance(key, TokenKey)
                or key.page_size != ps
                or len(key.data) != len(data) - len(data) % (ps * TOKEN_BYTES)
                or not data.startswith(key.data)
            )
        ):
            raise InvalidInput("key is not the key of the tokens' whole pages")
        ns = key.namespace if key is not None else check_namespace(namespace)
        root = self.cache.tree.root
        return RequestKV(ns, priority, ps, data, root, as_pages(), key, prefetched=prefetched)

    def prefill(self, req: RequestKV, upto: int) -> Fill | None:
        """Place KV for the request's tokens up to ``upto`` (a chunk end or the whole
        prompt): whole pages into the tree, the rest into its own page. ``None``
        when L1 has no room now (nothing changed)."""
        self._check_open(req)
        if not isinstance(upto, int) or not req.filled <= upto <= req.num_tokens:
            raise InvalidInput(
                f"prefill up to {upto!r} is refused: allowed is an int in "
                f"[{req.filled}, {req.num_tokens}] (filled .. known tokens)"
            )
        ps = req.page_size
        aligned = upto - upto % ps
        if aligned <= req.cached_tokens:
            return self._fill_tail(req, upto)
        return self._fill_pages(req, aligned, upto)

    def append(self, req: RequestKV, tokens: bytes) -> Fill | None:
        """Decode: ``tokens`` (packed) join the request and their KV is placed. ``None``
        (the tokens not added) when L1 has no room now."""
        self._check_open(req)
        if not isinstance(tokens, bytes) or not tokens or len(tokens) % TOKEN_BYTES:
            raise InvalidInput("append takes packed uint32 token ids (non-empty bytes)")
        if req.filled != req.num_tokens:
            raise InvalidInput(
                f"append before the prompt is filled ({req.filled} of {req.num_tokens} tokens)"
            )
        if not isinstance(req.tokens, bytearray):
            req.tokens = bytearray(req.tokens)
        req.key = None
        req.tokens += tokens
        fill = self.prefill(req, req.num_tokens)
        if fill is None:
            del req.tokens[len(req.tokens) - len(tokens) :]
        return fill

    def end(self, req: RequestKV) -> TreeNode:
        """Finish the request: free its own page; the lock it holds on the returned
        node passes to the caller (which drops it with ``dec_lock_ref``)."""
        self._check_open(req)
        if req.tail_page is not None:
            self.cache.placement.free_device((req.tail_page,))
            req.tail_page = None
        req.ended = True
        return req.node

    def release(self, req: RequestKV) -> None:
        """Finish or abort the request: nothing of it stays held (its placed whole
        pages stay cached, unlocked)."""
        self.cache.placement.dec_lock_ref(self.end(req))

    def finish(self, req: RequestKV, session: str | None = None) -> str | None:
        """The request is done. With ``session``, that session keeps its whole pages
        for the next turn (``fabric.cache.sessions``); returns why it could not, or
        ``None``."""
        if session is not None:
            check_session_id(session)
        node = self.end(req)
        if session is None:
            self.cache.placement.dec_lock_ref(node)
            return None
        return self.cache.sessions.keep(session, node)

    def end_session(self, session: str) -> bool:
        """Drop what ``session`` keeps; ``False`` if it kept nothing."""
        return self.cache.sessions.end(check_session_id(session))

    def expire(self) -> int:
        """End the sessions whose TTL passed and unpin the pins whose TTL passed
        (their budgets come back); returns how many sessions ended."""
        self.cache.pins.expire()
        return self.cache.sessions.expire()

    def pin(self, key: TokenKey, ttl_s: float) -> PinResult:
        """Keep ``key``'s cached prefix in L2 for ``ttl_s`` seconds within the pin budget."""
        return self.cache.pin_prefix(key, ttl_s)

    def unpin(self, key: TokenKey) -> int:
        """Unpin ``key``'s cached prefix; returns the tokens unpinned."""
        if not isinstance(key, TokenKey) or key.page_size != self.cache.page_size:
            raise InvalidInput(f"unpin takes a TokenKey of page size {self.cache.page_size}")
        return self.cache.pins.unpin(key)

    # -- internals -------------------------------------------------------------------

    def _check_open(self, req: RequestKV) -> None:
        if not isinstance(req, RequestKV):
            raise InvalidInput(f"expected a RequestKV, got {type(req).__name__}")
        if req.ended:
            raise InvalidInput("the request has ended; its KV is no longer held")

    def _fill_tail(self, req: RequestKV, upto: int) -> Fill | None:
        # Only the request's own page grows: the tokens stay within one partial page.
        start = req.cached_tokens
        if upto == req.filled:
            return Fill(start, upto, upto, as_pages(), req.node)
        if req.tail_page is None:
            got = self.cache.placement.alloc_device(req.page_size)
            if got is None:
                return None
            req.tail_page = got[0]
        first_new, req.filled = req.filled, upto
        req.computed += upto - first_new
        return Fill(start, first_new, upto, as_pages((req.tail_page,)), req.node)

    def _fill_pages(self, req: RequestKV, aligned: int, upto: int) -> Fill | None:
        cache, ps = self.cache, req.page_size
        key = req.key
        if key is None or key.num_tokens != aligned:
            key = TokenKey(bytes(req.tokens[: aligned * TOKEN_BYTES]), ps, req.namespace)
        # Our own pages are locked: the match reaches them.
        match = cache.placement.match_prefix(key, req.node)
        if cache.parts is not None and not req.filled:  # the request's admission
            cache.parts.count_match(cache.placement.last_path, cache.tree.pages)
        loaded_tokens = 0
        if match.host_tokens:
            loaded = cache.loads.load_back(match.last_host_node)
            if loaded is not None:
                loaded_tokens = loaded.tokens
                match = cache.placement.match_prefix(key, req.node)
        base = match.device_tokens
        cached, tail, rest = req.cached_tokens, req.tail_page, upto - aligned
        adopt = tail is not None and base == cached  # our own page becomes a tree page
        cache.placement.inc_lock_ref(match.last_device_node)
        new_tail = None
        if rest:  # a page of its own for the tokens past the last whole page
            got = cache.placement.alloc_device(ps)
            if got is None:
                cache.placement.dec_lock_ref(match.last_device_node)
                return None
            new_tail = got[0]
        node, given = match.last_device_node, as_pages()
        if aligned > base:
            extended = cache.placement.extend(key, match, req.priority, tail if adopt else None)
            if extended is None:
                if new_tail is not None:
                    cache.placement.free_device((new_tail,))
                cache.placement.dec_lock_ref(match.last_device_node)
                return None
            node, given = extended
        cache.placement.inc_lock_ref(node)
        cache.placement.dec_lock_ref(match.last_device_node)
        cache.placement.dec_lock_ref(req.node)
        if tail is not None and not adopt:
            cache.placement.free_device((tail,))  # the tree had that page: ours was a duplicate
        first_new = max(req.filled, base)
        _count_hits(req, first_new - req.filled, loaded_tokens, upto - first_new)
        req.node = node
        req.pages = match.device_pages + given
        req.tail_page = new_tail
        req.filled = upto
        # What is new starts in the page at ``base``: L1 had every page before it.
        pages = given if new_tail is None else given + as_pages((new_tail,))
        parts = cache.placement.fill_parts(node, match.last_device_node)
        if cache.parts is not None:
            # Fixed now: a later fill may give this prefix more (its writes still
            # pending when this request ends); its lock keeps these.
            req.parts_held = cache.parts.held(node, cache.tree.pages, len(req.pages))
        return Fill(base, first_new, upto, pages, match.last_device_node, parts)


def _count_hits(req: RequestKV, hits: int, loaded: int, computed: int) -> None:
    """Where a fill's ``hits`` tokens came from: of those L1 had, ``loaded`` came
    back from L2 just now — of which what the request prefetched from L3 counts
    as L3's — and the rest were in L1 already; ``computed`` tokens were not hits."""
    from_l2 = min(loaded, hits)
    from_l3 = min(req.prefetched, from_l2)
    req.prefetched -= from_l3
    req.storage_hit += from_l3
    req.host_hit += from_l2 - from_l3
    req.device_hit += hits - from_l2
    req.computed += computed
