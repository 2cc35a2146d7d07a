"""Socket rounds (``fabric.round_sockets``) without Ray: servers in this process
standing for ranks, each with a ``step`` the test controls."""

import asyncio
import threading
import time

import pytest
import zmq

from fabric.round_sockets import LoopSocket, RoundServer, RoundSockets

MAX = 1 << 20


def run(coro):
    return asyncio.run(coro)


def echo(tag: bytes):
    return lambda batch: tag + batch


async def linked(servers, count=None):
    sockets = RoundSockets(count or len(servers), MAX)
    for i, server in enumerate(servers):
        sockets.connect(i, server.endpoint, server.secret)
    return sockets


def test_a_round_brings_every_ranks_reply_with_its_time():
    servers = [
        RoundServer(echo(b"r0:"), "127.0.0.1", MAX),
        RoundServer(echo(b"r1:"), "127.0.0.1", MAX),
    ]

    async def go():
        sockets = await linked(servers)
        try:
            first = await sockets.round(b"batch-1", 60)
            second = await sockets.round(b"batch-2", 60)
        finally:
            sockets.close()
        return first, second

    try:
        (replies, took), (again, _) = run(go())
    finally:
        for s in servers:
            s.close()
    assert replies == [b"r0:batch-1", b"r1:batch-1"]
    assert again == [b"r0:batch-2", b"r1:batch-2"]
    assert all(t is not None and t >= 0 for t in took)
    assert [s.served for s in servers] == [2, 2]


def test_a_step_that_raises_is_named_and_the_rank_counts_as_absent():
    def bad(batch):
        raise ValueError(f"cannot take {batch!r}")

    server = RoundServer(bad, "127.0.0.1", MAX)

    async def go():
        sockets = await linked([server])
        try:
            return await sockets.round(b"x", 60)
        finally:
            sockets.close()

    try:
        replies, took = run(go())
    finally:
        server.close()
    assert replies == ["ValueError: cannot take b'x'"]
    assert took == [None]


def test_a_message_without_the_ranks_secret_is_dropped_unanswered():
    calls = []
    server = RoundServer(lambda b: calls.append(b) or b"report", "127.0.0.1", MAX)

    async def go():
        sockets = RoundSockets(1, MAX)
        sockets.connect(0, server.endpoint, b"\x00" * len(server.secret))
        try:
            return await sockets.round(b"x", 0.5)
        finally:
            sockets.close()

    try:
        replies, _ = run(go())
        # Malformed shapes are dropped too: a raw DEALER that knows no framing.
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(server.endpoint)
        raw.send_multipart([server.secret, b"short", b"x"])  # a sequence number of 5 bytes
        raw.send_multipart([b"only one frame"])
        assert raw.poll(500) == 0
        raw.close()
        ctx.term()
    finally:
        server.close()
    assert replies == ["no reply within 0.5 s"]
    assert calls == []
    assert server.dropped == 3 and server.served == 0


def test_a_late_reply_is_not_taken_for_the_next_rounds():
    release = threading.Event()

    def slow(batch):
        if batch == b"first":
            release.wait(30)
        return b"report of " + batch

    server = RoundServer(slow, "127.0.0.1", MAX)

    async def go():
        sockets = await linked([server])
        try:
            late = await sockets.round(b"first", 0.2)
            release.set()  # the first reply now comes, to a round that is over
            return late, await sockets.round(b"second", 60)
        finally:
            sockets.close()

    try:
        (late, _), (replies, _) = run(go())
    finally:
        release.set()
        server.close()
    assert late == ["no reply within 0.2 s"]
    assert replies == [b"report of second"]
    assert server.served == 2


def test_a_rank_whose_socket_closes_is_named_at_once_not_at_the_deadline():
    """The round's deadline is an hour: it ends because the connection closed."""
    entered = threading.Event()
    server = RoundServer(
        lambda b: entered.set() or threading.Event().wait(30) or b"", "127.0.0.1", MAX
    )
    other = RoundServer(echo(b"ok:"), "127.0.0.1", MAX)

    async def go():
        sockets = await linked([server, other])
        try:
            round_ = asyncio.ensure_future(sockets.round(b"x", 3600))
            await asyncio.to_thread(entered.wait, 30)
            server._sock.close(linger=0)  # as the rank's process ending closes it
            replies, _ = await round_
            return replies, sockets.usable(0), sockets.usable(1)
        finally:
            sockets.close()

    try:
        replies, usable0, usable1 = run(go())
    finally:
        server._stop.set()
        other.close()
    assert "closed" in replies[0] and server.endpoint in replies[0]
    assert replies[1] == b"ok:x"
    assert (usable0, usable1) == (False, True)


def test_ranks_without_a_link_are_absent_with_the_callers_reason():
    server = RoundServer(echo(b""), "127.0.0.1", MAX)

    async def go():
        sockets = RoundSockets(3, MAX)
        sockets.connect(1, server.endpoint, server.secret)
        try:
            return await sockets.round(b"x", 60, {0: "rank 0 is restarting"})
        finally:
            sockets.close()

    try:
        replies, _ = run(go())
    finally:
        server.close()
    assert replies == ["rank 0 is restarting", b"x", "no round socket to this rank"]


def test_under_rays_encrypted_traffic_rounds_and_submits_go_as_ray_calls(monkeypatch):
    """The sockets are not encrypted: with RAY_USE_TLS on, Ray calls carry both."""
    from fabric.round_sockets import ray_tls

    for value, encrypted in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("RAY_USE_TLS", value)
        assert ray_tls() is encrypted
    monkeypatch.delenv("RAY_USE_TLS")
    assert ray_tls() is False


def pair():
    """A ROUTER bound on loopback and a DEALER connected to it (one context)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return ctx, router, dealer


def test_a_loop_socket_takes_what_came_before_it_watched_and_more_than_a_turns_worth():
    ctx, router, dealer = pair()
    count = LoopSocket.DRAIN * 3 + 5
    for i in range(count):
        dealer.send(str(i).encode())

    async def go():
        heard = []
        got_all = asyncio.get_running_loop().create_future()

        def take(frames):
            heard.append(frames[1])
            if len(heard) == count:
                got_all.set_result(None)

        while not router.poll(0):  # every message is queued before the socket is watched
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        sock = LoopSocket(router, take)
        try:
            await asyncio.wait_for(got_all, 30)
        finally:
            sock.close()
        return heard

    try:
        heard = run(go())
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)
    assert heard == [str(i).encode() for i in range(count)]


def test_a_message_that_comes_while_the_socket_sends_elsewhere_is_not_missed():
    """A send takes in the descriptor's signal for a message that came just before
    it: the socket must ask after each send whether messages wait, or the
    message sits unseen until another one comes."""
    ctx, router, dealer = pair()
    replies = []

    def peer():
        dealer.send(b"A")
        time.sleep(0.15)  # while the loop is held, answering A later
        dealer.send(b"B")
        deadline = time.monotonic() + 10
        while len(replies) < 2 and time.monotonic() < deadline:
            if dealer.poll(100):
                replies.append(dealer.recv())

    async def go():
        loop = asyncio.get_running_loop()

        def answer_a_late(to):
            time.sleep(0.3)  # the loop is busy: B arrives unseen meanwhile
            sock.send([to, b"re:A"])

        def heard(frames):
            if frames[1] == b"A":
                loop.call_soon(answer_a_late, frames[0])
            else:
                sock.send([frames[0], b"re:" + frames[1]])

        sock = LoopSocket(router, heard)
        talker = threading.Thread(target=peer)
        talker.start()
        try:
            await asyncio.to_thread(talker.join)
        finally:
            sock.close()

    try:
        run(go())
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)
    assert replies == [b"re:A", b"re:B"]


def test_a_loop_socket_send_to_a_full_queue_raises_and_close_stops_watching():
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)  # connected to nobody: nothing can be queued
    dealer.linger = 0

    async def go():
        sock = LoopSocket(dealer, lambda frames: None)
        try:
            with pytest.raises(zmq.Again):
                sock.send([b"x"])
        finally:
            sock.close()
        assert dealer.closed
        sock.close()  # twice is harmless
        await asyncio.sleep(0.05)  # the loop runs on with the descriptor no longer watched

    try:
        run(go())
    finally:
        ctx.destroy(linger=0)
