"""An engine connector's line to the coordinator (``fabric.engines.fabric_link``):
calls larger than the coordinator takes are split, never refused; a lookup's
wait is bounded by one deadline; a reconnect runs on a thread of its own, so no
engine step waits for it; leases are released on their own."""

from __future__ import annotations

import threading

import pytest

from fabric.cache.engine_input import MAX_CHAINS_PER_CALL, MAX_PAGES_PER_CALL, StoredRun
from fabric.cache.engine_tree import EngineTree
from fabric.engines.fabric_link import FabricLink

TAG = "0123456789abcdef"


class Done:
    """A call's result, as Ray's object ref stands for it."""

    def __init__(self, value):
        self.value = value


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Done(self.fn(*args))


class FakeCoordinator:
    """The coordinator's engine calls over a real ``EngineTree`` (which refuses
    calls past its bounds, as the actor does)."""

    def __init__(self):
        self.pages = EngineTree()
        self.calls: list[tuple[str, int]] = []

        def lookup(tag, world, chains, leases, lease_s, release, place=""):
            self.calls.append(("lookup", len(chains)))
            self.pages.release(release)
            hits = self.pages.lookup(tag, world, chains, leases, lease_s, place=place)
            return hits, self.pages.take_orders()

        def report(tag, world, reports, place="", place_bytes=0, names=None):
            self.calls.append(("report", max(len(r) for r in reports.values())))
            events, drops = self.pages.report(tag, world, reports, names=names or ())
            return len(events), drops

        def forget(tag, world, hashes):
            self.calls.append(("forget", len(hashes)))
            return len(self.pages.forget(tag, world, hashes))

        self.engine_lookup = Method(lookup)
        self.engine_report = Method(report)
        self.engine_forget = Method(forget)


@pytest.fixture
def link(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: (
        [r.value for r in refs] if isinstance(refs, list) else refs.value))  # fmt: skip
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    link = FabricLink("f", "auto", "kvfabric", 5.0, 10.0)
    link.coordinator = FakeCoordinator()
    return link


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_a_step_with_more_requests_than_a_call_takes_is_split_and_answered(link):
    n = MAX_CHAINS_PER_CALL + 10
    runs = {0: [StoredRun("ns", None, (h(i),)) for i in range(n)]}
    link.report(TAG, 1, runs)  # more runs than one report takes: split too
    leases = [f"e/{i}" for i in range(n)]
    answers = link.lookup(TAG, 1, [[h(i)] for i in range(n)], leases, 30.0, [], 1e18)
    assert answers == [1] * n
    coordinator = link.coordinator
    assert [c for c in coordinator.calls if c[0] == "report"] == [
        ("report", MAX_CHAINS_PER_CALL), ("report", 10)]  # fmt: skip
    assert [c for c in coordinator.calls if c[0] == "lookup"] == [
        ("lookup", MAX_CHAINS_PER_CALL), ("lookup", 10)]  # fmt: skip
    assert coordinator.pages.leased == n
    link.release(TAG, 1, leases)
    assert coordinator.pages.leased == 0
    assert link.up


def test_forgetting_more_pages_than_a_call_takes_is_split(link):
    link.forget(TAG, 1, [h(i) for i in range(MAX_PAGES_PER_CALL + 1)])
    assert [n for kind, n in link.coordinator.calls if kind == "forget"] == [MAX_PAGES_PER_CALL, 1]
    assert link.up


def test_a_reconnect_runs_on_its_own_thread_and_no_step_waits_for_it(monkeypatch):
    gate, attempts = threading.Event(), []

    def connect(name, address, ray_namespace):
        attempts.append(name)
        gate.wait(30)
        raise ConnectionError("no fabric here")

    import fabric.client

    monkeypatch.setattr(fabric.client, "connect", connect)
    link = FabricLink("f", "auto", "kvfabric", 0.05, 0.0)
    link.start()  # waits timeout_s at most
    assert not link.up  # the attempt still hangs: down, at once
    assert link.lookup(TAG, 1, [[h(1)]], None, 0.0, [], 0.0) is None
    assert len(attempts) == 1  # one attempt at a time
    gate.set()
    link._connecting.join(5)
    assert not link.up and link._said_down


def test_the_engine_steps_on_while_the_fabrics_orders_wait_or_run_and_not_longer(link):
    """``busy`` (vLLM's ``has_pending_push_work``): orders the fabric handed back and
    not yet given to the workers, or given and not reported carried out by every
    rank, keep an idle engine stepping; orders never reported done are given up
    after ``ORDERS_STALL_S``."""
    from fabric.cache.engine_places import Order
    from fabric.engines import fabric_link

    now = [0.0]
    link.clock = lambda: now[0]
    assert not link.busy
    link.orders = [Order(TAG, 2, "l3", 1, (h(1),))]
    assert link.busy
    assert len(link.take_orders(2)) == 1 and link.busy  # two ranks carry it out
    link.orders_done(1)
    assert link.busy
    link.orders_done(1)
    assert not link.busy
    assert link.take_orders(2) == [] and not link.busy  # nothing handed: nothing to wait for
    link.orders = [Order(TAG, 2, "l3", 1, (h(2),))]
    link.take_orders(2)
    now[0] += fabric_link.ORDERS_STALL_S + 1
    assert not link.busy, "a worker that never reports does not keep the engine stepping"


class NamedRequest:
    """What ``PageNames`` reads of vLLM's ``Request``."""

    def __init__(self, pages: int, size: int = 2) -> None:
        self.block_hashes = [bytes([0xB0 + i]) * 32 for i in range(pages)]
        self.all_token_ids = list(range(pages * size + 1))  # and a token of a page not whole


def test_the_link_sends_vllms_names_of_its_pages_with_their_first_report(link):
    """Only while the fabric publishes KV events (set as the link attaches): the
    pages a request stores are paired with vLLM's block hashes and tokens, and
    each pair goes with the first report naming the page."""
    from fabric.cache.engine_input import PageName
    from fabric.cache.keys import pack_tokens
    from fabric.engines.vllm_names import PageNames

    request, hashes = NamedRequest(3), [h(i) for i in range(3)]
    link.names.learn(request, hashes, 0, 3, 2)
    assert len(link.names) == 0  # no events published: nothing kept
    link.names.wanted = True
    link.names.learn(request, hashes, 1, 5, 2)  # (pages past vLLM's whole blocks: none)
    assert len(link.names) == 2
    link.report(TAG, 1, {0: [StoredRun("ns", None, (h(0),)), StoredRun("ns", h(0), (h(1),))]})
    assert link.coordinator.pages.names == {
        (TAG, 1, h(1)): (request.block_hashes[1], pack_tokens([2, 3]))
    }
    assert link.names.take([h(1), h(2)]) == [
        PageName(h(2), request.block_hashes[2], pack_tokens([4, 5]))
    ]
    bounded = PageNames(max_names=2)
    bounded.wanted = True
    bounded.learn(request, hashes, 0, 3, 2)
    assert [n.page for n in bounded.take(hashes)] == hashes[1:]  # the oldest went first
    request.block_hashes = [1, 2, 3]  # (not bytes: not vLLM's sha256 names)
    bounded.learn(request, hashes, 0, 3, 2)
    assert len(bounded) == 0
