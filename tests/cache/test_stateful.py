"""Random operation sequences against a simple model, ``check_integrity`` after each."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fabric.cache.l3_queues import PrefetchState
from fabric.config import PrefetchConfig
from tests.helpers import FakeClock, P, machine_settings, make_cache, toks

page_lists = st.lists(st.integers(0, 3), min_size=1, max_size=6)
namespaces = st.sampled_from(["a", "b"])


class CacheMachine(RuleBasedStateMachine):
    """Model: every page-prefix ever inserted or prefetched, per namespace (the tree
    may forget any of them, never hold one it was not given), plus the locks we hold
    (their prefixes must stay on device)."""

    @initialize(
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction_policy=st.sampled_from(["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]),
        stop_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
    )
    def setup(self, write_policy, eviction_policy, stop_policy):
        self.clock = FakeClock()
        self.cache = make_cache(
            device_pages=10,
            host_pages=20,
            clock=self.clock,
            write_policy=write_policy,
            eviction_policy=eviction_policy,
            pin_budget_fraction=0.5,
            prefetch=PrefetchConfig(
                threshold_tokens=P,
                stop_policy=stop_policy,
                timeout_base_s=1,
                max_inflight_fraction=1.0,
            ),
        )
        self.cache.storage.attach()
        self.known: set[tuple[str, tuple[int, ...]]] = set()
        self.locks: list[tuple[object, str, tuple[int, ...]]] = []
        self.next_req = 0

    def key(self, ns, pages):
        return self.cache.key(toks(*pages), ns)

    def remember(self, ns, pages):
        self.known.update((ns, tuple(pages[:i])) for i in range(1, len(pages) + 1))

    @rule(ns=namespaces, pages=page_lists, priority=st.integers(0, 2))
    def insert(self, ns, pages, priority):
        c = self.cache
        key = self.key(ns, pages)
        m = c.match_prefix(key)
        c.inc_lock_ref(m.last_device_node)
        fresh = c.alloc_device(key.num_tokens - m.device_tokens)
        c.dec_lock_ref(m.last_device_node)
        if fresh is None:
            return
        m = c.match_prefix(key)
        if len(m.device_pages) + len(fresh) != key.num_pages:
            c.free_device(fresh)  # eviction shortened our own match meanwhile
            return
        c.insert(key, m.device_pages + fresh, priority)
        self.remember(ns, pages)
        assert c.match_prefix(key).device_tokens == key.num_tokens

    @rule(ns=namespaces, pages=page_lists)
    def match(self, ns, pages):
        m = self.cache.match_prefix(self.key(ns, pages))
        n = m.matched_tokens // P
        assert n == 0 or (ns, tuple(pages[:n])) in self.known

    @rule(ns=namespaces, pages=page_lists)
    def lock(self, ns, pages):
        m = self.cache.match_prefix(self.key(ns, pages))
        if m.device_tokens:
            self.cache.inc_lock_ref(m.last_device_node)
            self.locks.append((m.last_device_node, ns, tuple(pages[: m.device_tokens // P])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.cache.evict(n * P)

    @rule(n=st.integers(0, 12))
    def evict_host(self, n):
        self.cache.evict_host(n * P)

    @rule(ns=namespaces, pages=page_lists, quota=st.none() | st.integers(0, 8))
    def load_back(self, ns, pages, quota):
        m = self.cache.match_prefix(self.key(ns, pages))
        if m.host_tokens:
            self.cache.load_back(m.last_host_node, None if quota is None else quota * P)

    @rule(data=st.data())
    def complete_writes(self, data):
        pending = [op.op_id for op in self.cache.pending_writes]
        n = data.draw(st.integers(0, len(pending)))
        failed = data.draw(st.sets(st.sampled_from(pending))) if pending else set()
        self.cache.complete_writes(n, failed)

    @rule()
    def write_through(self):
        self.cache.write_through()

    @rule()
    def flush(self):
        c = self.cache
        c.complete_writes(len(c.pending_writes))
        c.complete_loads(len(c.pending_loads))
        c.complete_backups(len(c.storage.backups))

    @rule(data=st.data())
    def complete_loads(self, data):
        self.cache.complete_loads(data.draw(st.integers(0, len(self.cache.pending_loads))))

    @rule(data=st.data())
    def complete_backups(self, data):
        pending = [op.op_id for op in self.cache.storage.backups]
        n = data.draw(st.integers(0, len(pending)))
        failed = data.draw(st.sets(st.sampled_from(pending))) if pending else set()
        self.cache.complete_backups(n, failed)

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
        if self.cache.storage.start_prefetch(
            self.next_req, key, self.cache.match_prefix(key)
        ).op_id:
            self.remember(ns, pages)

    @rule(data=st.data())
    def prefetch_event(self, data):
        ops = list(self.cache.storage.by_op.values())
        if not ops:
            return
        op = data.draw(st.sampled_from(ops))
        s = self.cache.storage
        if op.state is PrefetchState.QUERY:
            s.complete_query(op.op_id, data.draw(st.integers(0, len(op.page_hashes))))
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
        s = self.cache.storage
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
        for node, ns, pages in self.locks:
            assert node.device_value is not None
            # peek, not match_prefix: the check must not split nodes or refresh access times
            key = self.key(ns, list(pages))
            assert self.cache.tree.peek_device_pages(ns, key.data) >= len(pages)


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
