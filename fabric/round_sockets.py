"""Both ends of the socket rounds (``runtime.round_transport = "zmq"``): a round's
batch to every rank and their reports back over ZeroMQ instead of one Ray call per
rank: a round to two ranks costs the coordinator 0.22 ms of CPU against 1.15
over Ray calls, ~0.06 ms a rank against ~0.47 (``bench/ray_call_floor.py``),
and the Ray calls were most of a round's cost at engine-step batches.

**The rank's end** (``RoundServer``) binds a ROUTER socket on its node's address
(a port the kernel picks) and serves it on a thread of its own: each message is
one round's batch, answered with the rank's report by the same ``step`` a Ray
call runs. The coordinator learns the address and a secret made there by a Ray
call to the rank (``RankActor.round_endpoint``), so a message without the secret
is dropped unanswered: the socket listens on the cluster's network, and only the
process that asked the rank through Ray may drive it.

**The coordinator's end** (``RoundSockets``) holds one DEALER socket per rank and
gathers a round's replies in the event loop. What a Ray call would have told, the
sockets tell too:

- a rank whose process ends closes its connection: a monitor on each socket
  hears it, and the round ends for that rank at once with the reason (as a call
  to a dead actor fails at once), rather than at the deadline;
- a rank that does not reply in time is named as such; its late reply carries an
  old sequence number and is dropped when it comes;
- a rank whose step raised says why, and counts as absent for the round.

A link lost either way is dropped: the caller (``actors.rank_group``) asks the
rank, through Ray, for its new address before the next round (a restarted rank
binds a new port).

Frames, coordinator to rank: the secret, the round's sequence number (8 bytes),
the batch. Rank to coordinator: the sequence number, then ``OK`` and the report,
or ``FAILED`` and why the step raised (``"TypeName: message"``, as a failed Ray
call reads). A message that breaks that shape, or exceeds the message bound, is
dropped. Under a Ray cluster whose own traffic is encrypted (``RAY_USE_TLS``)
rounds go as Ray calls instead (``ray_tls``): these sockets are not encrypted."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping

import zmq

log = logging.getLogger(__name__)

OK, FAILED = b"\x00", b"\x01"
SECRET_BYTES = 16
SEQ_BYTES = 8
POLL_MS = 100  # how often the serving thread looks at its stop flag


def ray_tls() -> bool:
    """Whether Ray's own traffic is encrypted (``RAY_USE_TLS``, set for every process
    of such a cluster): these sockets are not, so rounds and submits then go as
    Ray calls whatever ``runtime.round_transport`` and ``submit_transport`` say."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def bind_router(ctx: zmq.Context, host: str, max_bytes: int) -> tuple[zmq.Socket, str]:
    """A ROUTER socket of ``ctx`` bound on ``host`` at a port the kernel picks, that
    drops messages past ``max_bytes`` (plus the frames around them); its address."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + SECRET_BYTES + SEQ_BYTES + 64)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


class LoopSocket:
    """A ZeroMQ socket served in the running asyncio loop without a future per
    message: its descriptor wakes the loop, which then takes every message
    waiting (``DRAIN`` a turn) and hands each to ``heard``; sends go at once,
    never waiting (``zmq.Again`` when the socket's queue is full). ZeroMQ's
    descriptor signals edges, not levels, so after each send the socket is asked
    whether messages wait (a send may have taken in the signal for them)."""

    DRAIN = 64  # messages taken a loop turn, so that no socket starves the others

    def __init__(self, sock: zmq.Socket, heard: Callable[[list[bytes]], None]) -> None:
        self.sock, self._heard = sock, heard
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self.drain)
        self._loop.call_soon(self.drain)  # what came before the descriptor was watched

    def drain(self) -> None:
        sock = self.sock
        for _ in range(self.DRAIN):
            try:
                if sock.closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing after all, or the socket is closing
                return
            self._heard(frames)
        self._loop.call_soon(self.drain)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self.drain)

    def close(self) -> None:
        """Stop watching the socket and close it (from the loop's thread)."""
        if not self.sock.closed:
            self._loop.remove_reader(self._fd)
            self.sock.close(linger=0)


class RoundServer:
    def __init__(self, step: Callable[[bytes], bytes], host: str, max_bytes: int) -> None:
        """Bind on ``host`` (an IP address of this node) and serve ``step`` until
        ``close``. ``max_bytes`` bounds a batch; a larger message is dropped."""
        self.step = step
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._ctx = zmq.Context()
        self._sock, self.endpoint = bind_router(self._ctx, host, max_bytes)
        self.served = 0
        self.dropped = 0
        self.failed: str | None = None  # why the socket stopped serving, if it did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-rounds", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
                reply = self._answer(frames[1:])
                if reply is None:
                    self.dropped += 1
                    continue
                sock.send_multipart([frames[0], *reply])
                self.served += 1
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                self.failed = f"{type(exc).__name__}: {exc}"
                log.exception("the round socket failed: this rank serves no more socket rounds")
        finally:
            sock.close(linger=0)
            self._ctx.term()

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to one message, or ``None`` to drop it."""
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            return None
        secret, seq, batch = frames
        if not hmac.compare_digest(secret, self.secret):
            return None
        try:
            return [seq, OK, self.step(batch)]
        except Exception as exc:  # the coordinator counts this rank as absent this round
            return [seq, FAILED, f"{type(exc).__name__}: {str(exc)[:200]}".encode()]

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving and close the socket (a round in progress finishes first)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


class _Link:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        secret: bytes,
        max_bytes: int,
        heard: Callable[[list[bytes]], None],
        lost: Callable[[list[bytes]], None],
    ) -> None:
        self.endpoint, self.secret = endpoint, secret
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + SEQ_BYTES + 64)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        self.sock = LoopSocket(sock, heard)
        self.monitor = LoopSocket(monitor, lost)
        self.lost: str | None = None  # why the link is unusable

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


class RoundSockets:
    def __init__(self, count: int, max_bytes: int) -> None:
        self._ctx = zmq.Context()
        self.max_bytes = max_bytes
        self.links: list[_Link | None] = [None] * count
        self.seq = 0
        # The round in progress: its sequence number, when it was sent, and how a
        # rank of it finishes (its reply, its disconnect).
        self._round: tuple[bytes, float, Callable[[int, bytes | str, float | None], None]] | None
        self._round = None

    def usable(self, index: int) -> bool:
        """Whether rank ``index`` has a link that is not known to be lost."""
        link = self.links[index]
        return link is not None and link.lost is None

    def connect(self, index: int, endpoint: str, secret: bytes) -> None:
        """Link rank ``index`` at ``endpoint`` (dropping its old link); from the loop."""
        self.drop(index)
        link: _Link | None = None

        def heard(frames: list[bytes]) -> None:
            if self.links[index] is link:
                self._heard(index, frames)

        def lost(_event: list[bytes]) -> None:
            """The rank's side of the connection closed."""
            assert link is not None
            if link.lost is None:
                link.lost = f"the rank's round socket at {endpoint} closed (its process ended?)"
            if self._round is not None and self.links[index] is link:
                self._round[2](index, link.lost, None)

        link = _Link(self._ctx, endpoint, secret, self.max_bytes, heard, lost)
        self.links[index] = link

    def drop(self, index: int) -> None:
        link, self.links[index] = self.links[index], None
        if link is not None:
            link.close()

    def _heard(self, index: int, frames: list[bytes]) -> None:
        """Rank ``index``'s reply: to the round in progress, or a late one, dropped."""
        if self._round is None or len(frames) != 3 or frames[0] != self._round[0]:
            return
        _, sent, finish = self._round
        if frames[1] == OK:
            finish(index, frames[2], time.perf_counter() - sent)
        elif frames[1] == FAILED:
            finish(index, frames[2].decode(errors="replace"), None)
        else:
            link = self.links[index]
            finish(index, f"a malformed reply from {link.endpoint if link else '?'}", None)

    async def round(
        self, batch: bytes, timeout_s: float, absent: Mapping[int, str] | None = None
    ) -> tuple[list[bytes | str], list[float | None]]:
        """Send ``batch`` to every linked rank; per rank, its report bytes or why
        there is none (``absent`` names why for ranks the caller could not link),
        and how long its reply took."""
        self.seq += 1
        seq = self.seq.to_bytes(SEQ_BYTES, "little")
        count = len(self.links)
        out: list[bytes | str] = [""] * count
        reply_s: list[float | None] = [None] * count
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        pending: set[int] = set()

        def finish(index: int, value: bytes | str, took: float | None) -> None:
            if index in pending:
                out[index], reply_s[index] = value, took
                pending.discard(index)
                if not pending and not done.done():
                    done.set_result(None)

        self._round = (seq, time.perf_counter(), finish)
        for index, link in enumerate(self.links):
            if link is None or link.lost is not None:
                why = link.lost if link is not None else None
                out[index] = why or (absent or {}).get(index) or "no round socket to this rank"
                continue
            try:
                link.sock.send([link.secret, seq, batch])
            except zmq.ZMQError as exc:  # its queue is full: the rank has long stopped reading
                link.lost = f"the round could not be sent to {link.endpoint}: {exc}"
                out[index] = link.lost
                continue
            pending.add(index)
        timer = loop.call_later(timeout_s, lambda: done.done() or done.set_result(None))
        try:
            if pending:
                await done
        finally:
            timer.cancel()
            self._round = None
            for index in list(pending):
                finish(index, f"no reply within {timeout_s} s", None)
        return out, reply_s

    def close(self) -> None:
        for index in range(len(self.links)):
            self.drop(index)
        self._ctx.destroy(linger=0)
