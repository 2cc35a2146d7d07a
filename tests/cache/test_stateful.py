"""Random operation sequences against a simple model, ``check_integrity`` after each."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fabric.cache.admission import Admission
from fabric.cache.keys import chain_hashes, pack_tokens, unpack_tokens
from fabric.cache.l3_transfers import PrefetchState
from fabric.config import PrefetchConfig
from policies import EVICTION_POLICIES
from tests.helpers import (
    FakeClock,
    P,
    RouterView,
    hybrid_model,
    machine_settings,
    make_cache,
    toks,
)

page_lists = st.lists(st.integers(0, 3), min_size=1, max_size=6)
# "sglang" seeds its chain with nothing (SGLang's unseeded chain), "sglang:x" with
# SGLang's seed: every tree path must hold for those chains too.
namespaces = st.sampled_from(["a", "b", "sglang", "sglang:x"])
sessions = st.sampled_from(["s1", "s2"])
loose_tokens = st.lists(st.integers(0, 3), max_size=5)


def answer_hashes(op, how: str) -> list[bytes] | None:
    """A hit query's hashes as an answerer gives them: none, the right chain, or a
    chain whose last hash is wrong (the cache must refuse it)."""
    if how == "none":
        return None
    pb = op.key.page_bytes
    hashes = chain_hashes(op.prev_hash, op.key.data[op.start_page * pb :], pb)
    if how == "bad":
        hashes[-1] = bytes(32)
    return hashes


class CacheMachine(RuleBasedStateMachine):
    """Model: every page-prefix ever inserted or prefetched, per namespace (the tree
    may forget any of them, never hold one it was not given), plus the locks we hold
    (their prefixes must stay on device) and the requests in the lifecycle (their
    pages must stay theirs)."""

    @initialize(
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction_policy=st.sampled_from(sorted(EVICTION_POLICIES)),
        stop_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
        session_tier=st.sampled_from(["device", "host"]),
        hybrid=st.sampled_from([None, "sliding", "mamba", "both"]),
        window=st.sampled_from([2, 6, 10]),
        tight_l2=st.booleans(),
        checkpoint_pages=st.sampled_from([0, 1, 2]),
    )
    def setup(
        self,
        write_policy,
        eviction_policy,
        stop_policy,
        session_tier="device",
        hybrid=None,
        window=6,
        tight_l2=False,
        checkpoint_pages=0,
    ):
        self.clock = FakeClock()
        # A hybrid model's component pools are small, so components are evicted
        # apart from the full pages (tombstones, dead leaves); with ``tight_l2`` its
        # L2 component pools too (L2 tombstones, the per-component L2 queues).
        parts = {}
        if hybrid is not None:
            parts = {
                "model": hybrid_model(hybrid, window),
                "sliding_tokens": 6 * P,
                "mamba_states": 3,
            }
            if tight_l2:
                parts |= {"host_sliding_tokens": 4 * P, "host_mamba_states": 2}
            if hybrid in ("mamba", "both"):  # mamba states inside long prefixes
                parts["mamba_checkpoint_tokens"] = checkpoint_pages * P
        self.cache = make_cache(
            device_pages=10,
            host_pages=20,
            clock=self.clock,
            write_policy=write_policy,
            eviction_policy=eviction_policy,
            pin_budget_fraction=0.5,
            session_tier=session_tier,
            session_budget_fraction=0.5,
            session_ttl_s=3,
            prefetch=PrefetchConfig(
                threshold_tokens=P,
                stop_policy=stop_policy,
                timeout_base_s=1,
                max_inflight_fraction=1.0,
            ),
            **parts,
        )
        self.cache.l3.attach()
        self.admission = Admission(self.cache)
        self.requests = []
        self.known: set[tuple[str, tuple[int, ...]]] = set()
        self.locks: list[tuple[object, str, tuple[int, ...]]] = []
        self.next_req = 0
        self.router = RouterView()

    def key(self, ns, pages):
        return self.cache.key(toks(*pages), ns)

    def remember(self, ns, pages):
        self.known.update((ns, tuple(pages[:i])) for i in range(1, len(pages) + 1))

    def remember_tokens(self, ns, data, upto):
        ids = unpack_tokens(bytes(data[: upto // P * P * 4]))
        pages = [ids[i : i + P] for i in range(0, len(ids), P)]
        self.remember(ns, [p[0] if len(set(p)) == 1 else tuple(p) for p in pages])

    # -- the request lifecycle ----------------------------------------------------

    @rule(ns=namespaces, pages=page_lists, tail=loose_tokens, priority=st.integers(0, 2))
    def begin(self, ns, pages, tail, priority):
        tokens = pack_tokens([*toks(*pages), *tail])
        self.requests.append(self.admission.begin(tokens, ns, priority))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), data=st.data())
    def prefill(self, i, data):
        req = self.requests[i % len(self.requests)]
        upto = data.draw(st.integers(req.filled, req.num_tokens))
        fill = self.admission.prefill(req, upto)
        if fill is not None:
            self.remember_tokens(req.namespace, req.tokens, upto)
            assert req.filled == fill.end == upto and fill.start % P == 0
            want = -(-(upto - fill.start) // P) if fill.new_tokens else 0
            assert len(fill.pages) == want

    @precondition(lambda self: any(r.filled == r.num_tokens for r in self.requests))
    @rule(i=st.integers(0, 100), tokens=loose_tokens.filter(bool))
    def append(self, i, tokens):
        ready = [r for r in self.requests if r.filled == r.num_tokens]
        req = ready[i % len(ready)]
        before = req.num_tokens
        if self.admission.append(req, pack_tokens(tokens)) is not None:
            self.remember_tokens(req.namespace, req.tokens, req.num_tokens)
        else:
            assert req.num_tokens == before

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), session=st.none() | sessions)
    def finish(self, i, session):
        self.admission.finish(self.requests.pop(i % len(self.requests)), session)

    @rule(session=sessions)
    def end_session(self, session):
        self.admission.end_session(session)

    @rule()
    def expire_sessions(self):
        self.admission.expire()

    @rule(ns=namespaces, pages=page_lists)
    def unpin(self, ns, pages):
        self.admission.unpin(self.key(ns, pages))

    @rule(ns=namespaces, pages=page_lists, priority=st.integers(0, 2))
    def insert(self, ns, pages, priority):
        c = self.cache
        key = self.key(ns, pages)
        m = c.placement.match_prefix(key)
        c.placement.inc_lock_ref(m.last_device_node)
        fresh = c.placement.alloc_device(key.num_tokens - m.device_tokens)
        c.placement.dec_lock_ref(m.last_device_node)
        if fresh is None:
            return
        m = c.placement.match_prefix(key)
        if len(m.device_pages) + len(fresh) != key.num_pages:
            c.placement.free_device(fresh)  # eviction shortened our own match meanwhile
            return
        last = c.placement.insert(key, m.device_pages + fresh, priority).last_node
        self.remember(ns, pages)
        # A hybrid prefix whose components found no room is cached, not served.
        if c.parts is None or c.parts.valid_end(last, c.tree.pages):
            assert c.placement.match_prefix(key).device_tokens == key.num_tokens

    @rule(ns=namespaces, pages=page_lists)
    def match(self, ns, pages):
        m = self.cache.placement.match_prefix(self.key(ns, pages))
        n = m.matched_tokens // P
        assert n == 0 or (ns, tuple(pages[:n])) in self.known
        parts = self.cache.parts
        if parts is not None:  # a hybrid match ends where every component serves it
            pages = self.cache.tree.pages
            assert parts.valid_end(m.last_device_node, pages)
            assert not m.host_tokens or parts.valid_end(m.last_host_node, pages)

    @rule(ns=namespaces, pages=page_lists)
    def lock(self, ns, pages):
        m = self.cache.placement.match_prefix(self.key(ns, pages))
        if m.device_tokens:
            self.cache.placement.inc_lock_ref(m.last_device_node)
            self.locks.append((m.last_device_node, ns, tuple(pages[: m.device_tokens // P])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.placement.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.cache.device_evictions.evict(n * P)

    @rule(n=st.integers(0, 12))
    def evict_host(self, n):
        self.cache.host_evictions.evict(n * P)

    @rule(component=st.sampled_from(["sliding", "mamba"]), n=st.integers(0, 4))
    def evict_host_component(self, component, n):
        parts = self.cache.parts
        if parts is None or not getattr(parts, component):
            return
        sliding = component == "sliding"
        queue = parts.host_sliding_lru if sliding else parts.host_mamba_lru
        free = [x for x in queue if not (x.host_ref or x.lock_ref)]
        evictable = sum(len(x.host_sliding) if sliding else 1 for x in free)
        before = {x: (x.host_value, x.sliding, x.mamba) for x in self.cache.tree.walk()}
        freed = parts.evict_host(component, n)
        assert min(n, evictable) <= freed <= evictable
        # Only L2-only values of the component went: full pages and L1 values stayed.
        assert {x: (x.host_value, x.sliding, x.mamba) for x in self.cache.tree.walk()} == before

    @rule(ns=namespaces, pages=page_lists, quota=st.none() | st.integers(0, 8))
    def load_back(self, ns, pages, quota):
        m = self.cache.placement.match_prefix(self.key(ns, pages))
        if m.host_tokens:
            self.cache.loads.load_back(m.last_host_node, None if quota is None else quota * P)

    @rule(data=st.data())
    def complete_writes(self, data):
        pending = [op.op_id for op in self.cache.writes.pending]
        n = data.draw(st.integers(0, len(pending)))
        failed = data.draw(st.sets(st.sampled_from(pending))) if pending else set()
        self.cache.writes.complete(n, failed)

    @rule()
    def write_through(self):
        self.cache.writes.write_through()

    @rule()
    def flush(self):
        c = self.cache
        c.writes.complete(len(c.writes.pending))
        c.loads.complete(len(c.loads.pending))
        c.l3.complete_backups(len(c.l3.backups))

    @rule(data=st.data())
    def complete_loads(self, data):
        self.cache.loads.complete(data.draw(st.integers(0, len(self.cache.loads.pending))))

    @rule(data=st.data())
    def complete_backups(self, data):
        pending = [op.op_id for op in self.cache.l3.backups]
        n = data.draw(st.integers(0, len(pending)))
        failed = data.draw(st.sets(st.sampled_from(pending))) if pending else set()
        self.cache.l3.complete_backups(n, failed)

    @rule(ns=namespaces, pages=page_lists, ttl=st.integers(1, 5))
    def pin(self, ns, pages, ttl):
        self.cache.pin_prefix(self.key(ns, pages), ttl)

    @rule(seconds=st.floats(0, 3))
    def advance(self, seconds):
        self.clock.advance(seconds)

    @rule(ns=namespaces, pages=page_lists)
    def start_prefetch(self, ns, pages):
        key = self.key(ns, pages)
        self.next_req += 1
        if self.cache.l3.start_prefetch(
            self.next_req, key, self.cache.placement.match_prefix(key)
        ).op_id:
            self.remember(ns, pages)

    @rule(data=st.data())
    def prefetch_event(self, data):
        ops = list(self.cache.l3.by_op.values())
        if not ops:
            return
        op = data.draw(st.sampled_from(ops))
        s = self.cache.l3
        if op.state is PrefetchState.QUERY:
            hit = data.draw(st.integers(0, op.num_pages))
            answer = data.draw(st.sampled_from(["none", "hashes", "bad"]))
            s.complete_query(op.op_id, hit, answer_hashes(op, answer))
        elif op.state is PrefetchState.LOADING:
            action = data.draw(st.sampled_from(["progress", "check", "abort"]))
            if action == "progress":
                s.update_progress(
                    op.op_id, data.draw(st.integers(0, 8)) * P, data.draw(st.booleans())
                )
            elif action == "check":
                s.check_prefetch(op.req_id)
            else:
                s.abort(op.req_id)
        else:
            s.complete_release(op.op_id)

    @rule(hit=st.integers(0, 6))
    def advance_all_prefetches(self, hit):
        s = self.cache.l3
        for op in list(s.by_op.values()):
            if op.state is PrefetchState.QUERY:
                s.complete_query(op.op_id, hit)
            elif op.state is PrefetchState.LOADING:
                s.update_progress(op.op_id, hit * P)
                s.check_prefetch(op.req_id)
            else:
                s.complete_release(op.op_id)

    @invariant()
    def integrity(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        parts = self.cache.parts
        for node, ns, pages in self.locks:
            assert node.device_value is not None
            # A locked match end keeps every component it was matched with.
            assert parts is None or parts.valid_end(node, self.cache.tree.pages)
            # peek, not match_prefix: the check must not split nodes or refresh access times
            key = self.key(ns, list(pages))
            assert self.cache.tree.peek_device_pages(ns, key.data) >= len(pages)
        root, tails = self.cache.tree.root, set()
        for req in self.requests:
            pages, node = [], req.node
            while node is not root:  # the request's pages are still the tree's
                assert node.lock_ref > 0 and node.device_value is not None
                pages[:0] = node.device_value
                node = node.parent
            assert pages == list(req.pages)
            assert (req.tail_page is None) == (req.filled == req.cached_tokens)
            assert 0 <= req.filled - req.cached_tokens < P
            if req.tail_page is not None:
                assert req.tail_page in self.cache.placement.leased and req.tail_page not in tails
                tails.add(req.tail_page)
        self.events_match_the_tree()

    def events_match_the_tree(self):
        self.router.apply(self.cache.events.take())
        self.router.check(self.cache.tree)


CacheMachine.TestCase.settings = machine_settings(examples=400, steps=60)
TestCacheMachine = CacheMachine.TestCase


def test_load_back_survives_the_l2_eviction_its_own_l1_eviction_causes():
    """Found by this machine: under write_back, making L1 room for a load-back wrote
    an L1 leaf back to L2, which evicted the very L2 chain being loaded."""
    m = CacheMachine()
    m.setup(write_policy="write_back", eviction_policy="mru", stop_policy="best_effort")
    m.start_prefetch("a", [1])
    m.insert("a", [1, 0, 0, 0, 0, 0], 0)
    m.advance_all_prefetches(1)
    m.start_prefetch("a", [0])
    m.start_prefetch("a", [0, 0, 0, 0])
    m.start_prefetch("a", [0, 0, 0, 0])
    m.start_prefetch("a", [0, 0])
    m.advance_all_prefetches(4)
    m.insert("a", [2, 0, 0, 0], 0)
    m.insert("a", [0], 0)
    m.insert("a", [0, 0, 0, 0, 0, 0], 0)
    m.load_back("a", [1], None)
    m.integrity()
