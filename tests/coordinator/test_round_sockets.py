"""Socket rounds (``fabric.round_sockets``) without Ray: servers in this process
standing for ranks, each with a ``step`` the test controls."""

import asyncio
import threading

import zmq

from fabric.round_sockets import RoundServer, RoundSockets

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
