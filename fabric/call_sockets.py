"""Drivers' submits over a socket (``runtime.submit_transport = "zmq"``): a call of
``submit`` or ``submit_many`` — and an engine connector's lookups, reports and
forgets (``fabric.engines.fabric_link``) — reaches the coordinator over ZeroMQ
instead of as a Ray actor call, which costs the coordinator about a millisecond
of CPU in Ray's own threads whatever the call carries (``bench/fabric_load.py``
shows it by thread); at engine-step batches that was a fifth or more of its CPU
per request.

**The coordinator's end** (``CallServer``) binds a ROUTER socket on its node's
address and serves it in its event loop: each message is one call, encoded with
msgspec (``SubmitCall``), answered with the call's results, or with the type
and text of the error it raised. A driver learns the address and a secret by a
Ray call (``CoordinatorActor.call_endpoint``); a message without the secret is
dropped unanswered.

**The driver's end** (``CallLink``) holds a DEALER socket per thread (a socket is
not thread safe; those of threads that ended close when the next one is made).
Before its first call it pings the coordinator; a driver that cannot reach the
address (Ray Client from outside the cluster's network, a firewall) is told so
and the ``Fabric`` handle goes on over Ray calls. A coordinator whose process
ends closes the connection: the call raises ``CallLost`` at once (as a Ray call
to a dead actor fails), and the handle asks the restarted coordinator for its
new address on the next call.

Frames, driver to coordinator: the secret, a sequence number (8 bytes), the call
(empty: a ping). Back: the sequence number, then ``OK`` and the results, or
``FAILED`` and ``(type name, message)``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq

from fabric.cache.engine_input import PageName, StoredRun
from fabric.coordinator.requests import Lease, RequestResult
from fabric.round_sockets import FAILED, OK, SECRET_BYTES, SEQ_BYTES, LoopSocket, bind_router

log = logging.getLogger(__name__)


class SubmitCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="submit"):
    """One ``submit_many`` call, as the actor method takes it."""

    prompts: list[bytes]
    namespace: str
    priority: int
    request_ids: list[str | None]
    owner: str | None
    session: str | None
    release: list[Lease]


class EngineLookupCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="lookup"):
    """One ``engine_lookup`` call (``fabric.engines.fabric_link``)."""

    engine_tag: str
    world: int
    chains: list[list[bytes]]
    leases: list[str] | None
    lease_s: float
    release: list[str]
    place: str
    needs: list[tuple[str, int]] = []  # a hybrid engine's component groups


class EngineReportCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="report"):
    """One ``engine_report`` call."""

    engine_tag: str
    world: int
    reports: dict[int, list[StoredRun]]
    place: str
    place_bytes: int
    names: list[PageName] = []


class EngineForgetCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="forget"):
    """One ``engine_forget`` call."""

    engine_tag: str
    world: int
    hashes: list[bytes]


class EngineHoldCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="hold"):
    """One ``engine_hold`` call."""

    engine_tag: str
    world: int
    chain: list[bytes]
    name: str
    kind: str
    ttl_s: float | None


class EngineDropCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="drop"):
    """One ``engine_drop`` call."""

    engine_tag: str
    world: int
    place: str
    hashes: list[bytes]
    everything: bool


Call = (
    SubmitCall
    | EngineLookupCall
    | EngineReportCall
    | EngineForgetCall
    | EngineHoldCall
    | EngineDropCall
)
_CALL = msgspec.msgpack.Decoder(Call)
_RESULTS = msgspec.msgpack.Decoder(list[RequestResult])
_ERROR = msgspec.msgpack.Decoder(tuple[str, str])
_ENCODE = msgspec.msgpack.Encoder()


def encode_call(call: SubmitCall) -> bytes | None:
    """The call's bytes; ``None`` when an argument is not of its type (or does not
    encode: a str that is not UTF-8, an int past 64 bits): such a call goes as a
    Ray call, and the coordinator's own checks name what is wrong with it."""
    text = (str, type(None))
    typed = (
        isinstance(call.prompts, list)
        and all(type(p) is bytes for p in call.prompts)
        and type(call.namespace) is str
        and type(call.priority) is int
        and all(isinstance(r, text) for r in call.request_ids)
        and isinstance(call.owner, text)
        and isinstance(call.session, text)
        and all(type(lease) is Lease for lease in call.release)
    )
    if not typed:
        return None
    try:
        return _ENCODE.encode(call)
    except (UnicodeEncodeError, OverflowError, TypeError, ValueError):
        return None


class CallLost(ConnectionError):
    """The coordinator's end of the socket closed during a call (its process ended):
    whether the call was served is unknown; a driver submits again."""


class CallServer:
    def __init__(
        self,
        serve: Callable[[Call], Awaitable[Any]],
        host: str,
        max_bytes: int,
    ) -> None:
        """Bind on ``host`` and serve calls with ``serve`` until ``close``; call
        from inside the running event loop."""
        self.serve = serve
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._ctx = zmq.Context()
        sock, self.endpoint = bind_router(self._ctx, host, max_bytes)
        self.served = 0
        self.dropped = 0
        self._calls: set[asyncio.Future] = set()
        self._sock = LoopSocket(sock, self._heard)

    def _heard(self, frames: list[bytes]) -> None:
        if (
            len(frames) != 4
            or len(frames[2]) != SEQ_BYTES
            or not hmac.compare_digest(frames[1], self.secret)
        ):
            self.dropped += 1
        elif not frames[3]:  # a ping
            self._reply([frames[0], frames[2], OK, b""])
        else:
            call = asyncio.ensure_future(self._answer(frames[0], frames[2], frames[3]))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _answer(self, peer: bytes, seq: bytes, payload: bytes) -> None:
        try:
            results = await self.serve(_CALL.decode(payload))
            reply = [peer, seq, OK, _ENCODE.encode(results)]
        except msgspec.ValidationError as exc:
            reply = [peer, seq, FAILED, _ENCODE.encode(("InvalidInput", f"a bad call: {exc}"))]
        except Exception as exc:
            reply = [peer, seq, FAILED, _ENCODE.encode((type(exc).__name__, str(exc)))]
        self.served += 1
        self._reply(reply)

    def _reply(self, frames: list[bytes]) -> None:
        """Send a reply; one that cannot go (the socket closing) is dropped: its
        driver's call ends by its timeout or, if the coordinator ends, at once."""
        try:
            self._sock.send(frames)
        except zmq.ZMQError:
            if not self._sock.sock.closed:
                log.warning("a reply to a driver could not be sent", exc_info=True)

    def close(self) -> None:
        for call in list(self._calls):
            call.cancel()
        self._sock.close()
        self._ctx.destroy(linger=0)


class _ThreadSocket:
    def __init__(self, ctx: zmq.Context, endpoint: str, max_bytes: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + SEQ_BYTES + 64)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class CallLink:
    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        max_bytes: int,
        stale: Callable[[list[RequestResult]], None] | None = None,
    ) -> None:
        """``stale`` takes the results of a call this link stopped waiting for that
        came later (to release their leases)."""
        self.endpoint, self.secret, self.max_bytes = endpoint, secret, max_bytes
        self.stale = stale
        self._ctx = zmq.Context()
        # Every socket of the link (the per-thread monitors included) lets go at
        # once when closed: a context destroyed with a message pending, or when the
        # link is collected unclosed, never blocks its thread.
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._local = threading.local()
        self._sockets: dict[threading.Thread, _ThreadSocket] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.lost = False

    def _socket(self) -> _ThreadSocket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = _ThreadSocket(self._ctx, self.endpoint, self.max_bytes)
            with self._lock:
                # The sockets of threads that have ended close here (a server's
                # pool that replaces its threads would otherwise gather them).
                for thread in [t for t in self._sockets if not t.is_alive()]:
                    self._sockets.pop(thread).close()
                self._sockets[threading.current_thread()] = sock
        return sock

    def send(self, payload: bytes) -> int:
        """Send one call (``b""``: a ping); returns its sequence number."""
        with self._lock:
            seq = next(self._seq)
        self._socket().sock.send_multipart(
            [self.secret, seq.to_bytes(SEQ_BYTES, "little"), payload], copy=len(payload) < 65536
        )
        return seq

    def receive(self, seq: int, timeout: float | None) -> list[RequestResult] | None:
        """The results of call ``seq`` (``None`` for a ping's reply). Raises
        ``TimeoutError`` past ``timeout``, ``CallLost`` when the coordinator's end
        closed, and the call's own error (``fabric.errors`` types by name, others
        as ``FabricError``)."""
        sock = self._socket()
        want = seq.to_bytes(SEQ_BYTES, "little")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = dict(sock.poller.poll(None if left is None else int(left * 1000)))
            if not events:
                raise TimeoutError(f"no reply from the coordinator within {timeout} s")
            if sock.monitor in events:
                self.lost = True
                raise CallLost(f"the coordinator's call socket at {self.endpoint} closed")
            frames = sock.sock.recv_multipart()
            if len(frames) != 3:
                continue
            if frames[0] != want:  # a call this thread stopped waiting for
                if frames[1] == OK and frames[2] and self.stale is not None:
                    self.stale(_RESULTS.decode(frames[2]))
                continue
            if frames[1] == OK:
                return _RESULTS.decode(frames[2]) if frames[2] else None
            raise _error(*_ERROR.decode(frames[2]))

    def next_reply(self, timeout: float) -> tuple[int, Any] | None:
        """The next reply this thread's socket has (within ``timeout``; ``None``
        when none came): its sequence number and its payload's bytes, or the
        call's error. Raises ``CallLost`` when the coordinator's end closed."""
        sock = self._socket()
        while True:
            events = dict(sock.poller.poll(int(timeout * 1000)))
            if not events:
                return None
            if sock.monitor in events:
                self.lost = True
                raise CallLost(f"the coordinator's call socket at {self.endpoint} closed")
            frames = sock.sock.recv_multipart()
            if len(frames) == 3:
                seq = int.from_bytes(frames[0], "little")
                return seq, frames[2] if frames[1] == OK else _error(*_ERROR.decode(frames[2]))

    def check(self) -> bool:
        """Whether the link still stands, as far as this thread's socket has heard
        (a coordinator that ended since this thread's last call closed it)."""
        sock = getattr(self._local, "sock", None)
        if sock is not None and sock.monitor.poll(0):
            self.lost = True
        return not self.lost

    def ping(self, timeout: float) -> bool:
        """Whether the coordinator answers within ``timeout``."""
        try:
            self.receive(self.send(b""), timeout)
            return True
        except (TimeoutError, CallLost):
            return False

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
        self._ctx.destroy(linger=0)

    def __del__(self) -> None:
        # A link dropped unclosed (an engine's link, a test's): its monitors are
        # disabled before the context goes, which would otherwise wait on them.
        with contextlib.suppress(Exception):
            if not self._ctx.closed:
                self.close()


def open_link(
    ask: Callable[[], tuple[str, bytes]],
    max_bytes: int,
    stale: Callable[[list[RequestResult]], None],
    ping_s: float = 5.0,
) -> CallLink | bool:
    """A link to the coordinator's call socket (``ask`` names its address and
    secret); ``False`` when it does not answer from here within ``ping_s`` (calls
    go over Ray from now on), ``True`` when the coordinator could not be asked now
    (over Ray this time; asked again next time)."""
    try:
        endpoint, secret = ask()
    except Exception as exc:  # restarting, say
        log.debug("the coordinator named no call socket now: %s", exc)
        return True
    link = CallLink(endpoint, secret, max_bytes, stale)
    if link.ping(ping_s):
        return link
    link.close()
    log.warning(
        "submits go as Ray calls: the coordinator's call socket at %s does not answer "
        "from here within %s s",
        endpoint,
        ping_s,
    )
    return False


def _error(kind: str, message: str) -> Exception:
    """The exception a call raised in the coordinator, as the driver raises it."""
    from fabric import errors

    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.FabricError):
        return cls(message)
    return errors.FabricError(f"{kind}: {message}")
