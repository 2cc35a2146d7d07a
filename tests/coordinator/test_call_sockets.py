"""Drivers' submits over a socket (``fabric.call_sockets``) without Ray: a
``CallServer`` on an event loop of its own thread, standing for the coordinator,
with a ``submit`` the test controls."""

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from fabric.call_sockets import CallLink, CallLost, CallServer, SubmitCall, encode_call, open_link
from fabric.coordinator.requests import Lease, RequestResult
from fabric.errors import FabricError, InvalidInput

MAX = 1 << 20
LEASE = Lease("r0", "t" * 32, 3, "default", 8, (4, 5), 300.0, ((1, 2),), ())


class Coordinator:
    """A CallServer on its own loop; ``submit`` answers calls."""

    def __init__(self, submit):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.calls = []

        async def make():
            async def recorded(call):
                self.calls.append(call)
                return await submit(call)

            return CallServer(recorded, "127.0.0.1", MAX)

        self.server = asyncio.run_coroutine_threadsafe(make(), self.loop).result(10)

    def link(self, stale=None):
        return CallLink(self.server.endpoint, self.server.secret, MAX, stale)

    def close(self, server_only=False):
        self.loop.call_soon_threadsafe(self.server.close)
        if not server_only:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def call(*prompts, release=()):
    ids = [f"r{i}" for i in range(len(prompts))]
    return SubmitCall(list(prompts), "default", 0, ids, "job-1", None, list(release))


async def served(call):
    return [
        RequestResult(rid, len(p) // 4, computed_tokens=len(p) // 4, lease=LEASE)
        for rid, p in zip(call.request_ids, call.prompts, strict=True)
    ]


def test_a_call_brings_its_results_and_the_leases_it_let_go_arrive_whole():
    c = Coordinator(served)
    link = c.link()
    try:
        assert link.ping(10)
        results = link.receive(
            link.send(encode_call(call(b"\0" * 8, b"\0" * 16, release=[LEASE]))), 30
        )
    finally:
        link.close()
        c.close()
    assert [(r.request_id, r.prompt_tokens, r.lease) for r in results] == [
        ("r0", 2, LEASE),
        ("r1", 4, LEASE),
    ]
    assert c.calls[0].release == [LEASE] and c.calls[0].owner == "job-1"


def test_the_coordinators_errors_are_raised_by_their_own_type():
    async def refuse(call):
        if call.namespace == "default":
            raise InvalidInput("namespace 'default' is refused")
        raise KeyError("boom")

    c = Coordinator(refuse)
    link = c.link()
    try:
        with pytest.raises(InvalidInput, match="'default' is refused"):
            link.receive(link.send(encode_call(call(b"\0" * 4))), 30)
        other = SubmitCall([b"\0" * 4], "ns", 0, ["x"], None, None, [])
        with pytest.raises(FabricError, match="KeyError: 'boom'"):
            link.receive(link.send(encode_call(other)), 30)
        # A call that does not decode is refused as bad input, naming the field.
        with pytest.raises(InvalidInput, match=r"a bad call: .*\$\[3\]"):
            bad = msgspec.msgpack.encode(["submit", [], "default", "high", [], None, None, []])
            link.receive(link.send(bad), 30)
        with pytest.raises(
            InvalidInput, match=r"a bad call: Invalid value 'steal'"
        ):  # no such call
            link.receive(link.send(msgspec.msgpack.encode(["steal", 1])), 30)
    finally:
        link.close()
        c.close()


def test_a_message_without_the_secret_is_dropped_unanswered():
    c = Coordinator(served)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(c.server.endpoint)
    try:
        raw.send_multipart([b"\0" * len(c.server.secret), b"\0" * 8, encode_call(call(b"\0" * 4))])
        raw.send_multipart([c.server.secret, b"short", b""])
        assert raw.poll(500) == 0
        assert c.calls == [] and c.server.dropped == 2
    finally:
        raw.close()
        ctx.term()
        c.close()


def test_a_late_reply_goes_to_the_stale_handler_not_to_the_next_call():
    release = threading.Event()

    async def slow_first(call):
        if call.request_ids == ["slow"]:
            await asyncio.to_thread(release.wait, 30)
        return await served(call)

    late = []
    c = Coordinator(slow_first)
    link = c.link(stale=late.extend)
    try:
        first = SubmitCall([b"\0" * 4], "default", 0, ["slow"], None, None, [])
        with pytest.raises(TimeoutError):
            link.receive(link.send(encode_call(first)), 0.2)
        release.set()
        deadline = time.monotonic() + 30
        while c.server.served < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the late reply is on its way before the next call goes
        results = link.receive(link.send(encode_call(call(b"\0" * 8))), 30)
    finally:
        release.set()
        link.close()
        c.close()
    assert [r.request_id for r in results] == ["r0"]
    assert [r.request_id for r in late] == ["slow"]


def test_a_closed_coordinator_ends_a_waiting_call_at_once_not_at_its_timeout():
    """The call's timeout is an hour: it ends because the connection closed."""
    entered = threading.Event()

    async def hang(call):
        entered.set()
        await asyncio.sleep(3600)

    c = Coordinator(hang)
    link = c.link()
    try:
        seq = link.send(encode_call(call(b"\0" * 4)))
        assert entered.wait(30)
        c.close(server_only=True)  # as the coordinator's process ending closes it
        with pytest.raises(CallLost, match="closed"):
            link.receive(seq, 3600)
        assert link.lost
    finally:
        link.close()
        c.close()


def test_an_address_that_does_not_answer_means_ray_calls_and_an_unasked_one_a_retry():
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # binds, never answers
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        made = open_link(lambda: (f"tcp://127.0.0.1:{port}", b"s" * 16), MAX, print, ping_s=0.3)
        assert made is False

        def restarting():
            raise ConnectionError("the coordinator is restarting")

        assert open_link(restarting, MAX, print) is True
    finally:
        silent.close()
        ctx.term()


@pytest.mark.parametrize(
    "field, value",
    [
        ("namespace", "tenant-\udcff"),  # not UTF-8
        ("namespace", 7),
        ("priority", True),  # a bool is not an int
        ("priority", 1 << 70),  # past 64 bits
        ("prompts", [bytearray(b"\0" * 4)]),
        ("request_ids", [3]),
        ("session", b"s"),
        ("release", [("r0", "t")]),
    ],
)
def test_a_call_with_an_argument_not_of_its_type_is_left_to_ray_calls(field, value):
    """``None``: the call goes as a Ray call, and the coordinator's own checks name
    the bad value (as they did before the socket)."""
    args = {f: getattr(call(b"\0" * 4), f) for f in SubmitCall.__struct_fields__}
    args[field] = value
    assert encode_call(SubmitCall(**args)) is None
    assert encode_call(call(b"\0" * 4, release=[LEASE])) is not None


class Unasked:
    """A coordinator handle that must not be asked for its call socket."""

    class call_endpoint:  # stands for an actor method
        @staticmethod
        def remote():
            raise AssertionError("asked for the call socket")


@pytest.mark.parametrize("how", ["config", "tls"])
def test_a_handle_takes_ray_calls_when_configured_or_rays_traffic_is_encrypted(monkeypatch, how):
    from fabric.client import Fabric
    from fabric.config import FabricConfig

    if how == "tls":
        monkeypatch.setenv("RAY_USE_TLS", "1")
        config = FabricConfig()
    else:
        monkeypatch.delenv("RAY_USE_TLS", raising=False)
        config = FabricConfig().with_overrides(["runtime.submit_transport=ray"])
    assert Fabric(Unasked(), config)._link() is None


def test_a_handle_sent_to_another_process_links_anew_there():
    import pickle

    from fabric.client import Fabric
    from fabric.config import FabricConfig

    linked = Fabric(Unasked(), FabricConfig())
    linked._calls = CallLink("tcp://127.0.0.1:9", b"s" * 16, MAX)
    try:
        copy = pickle.loads(pickle.dumps(linked))
    finally:
        linked._calls.close()
    assert copy._calls is None  # asks the coordinator for its socket on first use
    assert copy._calls_lock.acquire(blocking=False)
    ray_calls = Fabric(Unasked(), FabricConfig().with_overrides(["runtime.submit_transport=ray"]))
    assert pickle.loads(pickle.dumps(ray_calls))._calls is False


def test_each_thread_calls_on_its_own_socket_and_ended_threads_sockets_close():
    c = Coordinator(served)
    link = c.link()
    got = {}

    def one(k):
        got[k] = link.receive(link.send(encode_call(call(b"\0" * 4 * (k + 1)))), 30)

    try:
        for k in range(3):  # one after another: each thread ends before the next
            t = threading.Thread(target=one, args=(k,))
            t.start()
            t.join(30)
        one(3)  # this thread's own
        open_now = len(link._sockets)
    finally:
        link.close()
        c.close()
    assert [got[k][0].prompt_tokens for k in range(4)] == [1, 2, 3, 4]
    assert open_now == 1  # this thread's: each ended thread's closed as the next was made


def test_a_call_past_the_message_bound_goes_as_a_ray_call():
    from fabric.client import Fabric
    from fabric.config import FabricConfig

    f = Fabric(Unasked(), FabricConfig().with_overrides(["runtime.max_message_bytes=4096"]))
    f._calls = CallLink("tcp://127.0.0.1:9", b"s" * 16, 4096)
    try:
        assert f._over_socket(call(b"\0" * 400)) is not None
        assert f._over_socket(call(b"\0" * 4096)) is None
    finally:
        f._calls.close()


def test_a_link_dropped_unclosed_after_another_thread_used_it_goes_without_blocking():
    """An engine's link (or a test's) may be dropped without ``close``: collecting
    it closes its sockets and monitors, and never blocks the collecting thread."""
    import gc
    import weakref

    async def answer(c):
        return []

    c = Coordinator(answer)
    link = c.link()
    pinger = threading.Thread(target=link.ping, args=(10,))
    pinger.start()
    pinger.join(30)
    assert link.ping(10)
    gone = weakref.ref(link._ctx)
    collector = threading.Thread(target=gc.collect)
    del link
    collector.start()
    collector.join(30)
    assert not collector.is_alive(), "collecting the link blocked"
    gc.collect()
    assert gone() is None or gone().closed
    c.close()
