"""An engine link's calls over the coordinator's call socket (``fabric.call_sockets``,
``runtime.submit_transport = "zmq"``) rather than as Ray actor calls, which cost
the coordinator about a millisecond of CPU each in Ray's own threads: at an
engine step's lookup and report, several times the tree's own work
(``bench/fabric_load.py --engine-steps``).

Calls keep the link's order and semantics (``fabric.engines.fabric_link``):
reports, forgets and lease releases are sent without waiting, their replies
taken as they come (a report's carries the tree's orders, as a lookup's does);
a lookup first takes the replies of every call sent before it, so it never
overtakes a report.
One thread (the engine's scheduler) makes the calls: replies come back on its
socket in the order the coordinator answers them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from fabric.cache.engine_input import MAX_CHAINS_PER_CALL, PageName, StoredRun
from fabric.cache.engine_places import Order
from fabric.call_sockets import (
    CallLink,
    EngineDropCall,
    EngineForgetCall,
    EngineHoldCall,
    EngineLookupCall,
    EngineReportCall,
    open_link,
)

_ENCODE = msgspec.msgpack.Encoder()
_LOOKED = msgspec.msgpack.Decoder(tuple[list[int], list[Order]])
_REPORTED = msgspec.msgpack.Decoder(tuple[int, list[Order]])


def open_socket(
    ask: Callable[[], tuple[str, bytes]],
    max_bytes: int,
    ping_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> SocketCalls | None:
    """The socket link when the coordinator's call socket answers from here."""
    made = open_link(ask, max_bytes, lambda _: None, ping_s)
    return SocketCalls(made, clock) if isinstance(made, CallLink) else None


class SocketCalls:
    def __init__(self, link: CallLink, clock: Callable[[], float] = time.monotonic) -> None:
        self.link = link
        self.clock = clock
        self.sent: dict[int, str] = {}  # calls whose reply is not taken: seq -> kind
        self.orders: list[Order] = []  # from the replies to reports and lookups

    def lookup(
        self,
        tag: str,
        world: int,
        chains: list[list[bytes]],
        leases: list[str] | None,
        lease_s: float,
        release: list[str],
        place: str,
        deadline: float,
        needs: list[tuple[str, int]] | None = None,
    ) -> list[int]:
        """Every call sent before answered, then the lookups (in as many calls as the
        coordinator's bound asks), all by ``deadline``; raises ``TimeoutError``,
        ``CallLost`` or the coordinator's error."""
        self.settle(0, deadline)
        seqs = []
        for at in range(0, len(chains), MAX_CHAINS_PER_CALL):
            part = slice(at, at + MAX_CHAINS_PER_CALL)
            call = EngineLookupCall(
                tag, world, [list(c) for c in chains[part]], list(leases[part]) if leases else None,
                float(lease_s), list(release) if at == 0 else [], place,
                [list(n) for n in needs or ()],
            )  # fmt: skip
            seqs.append(self._send(call, "lookup"))
        answers: dict[int, list[int]] = {}
        while len(answers) < len(seqs):
            seq, payload = self._take(deadline)
            if seq in seqs:
                hits, orders = _LOOKED.decode(payload)
                answers[seq] = hits
                self.orders += orders
        return [hit for seq in seqs for hit in answers[seq]]

    def report(
        self,
        tag: str,
        world: int,
        part: dict[int, list[StoredRun]],
        place: str,
        place_bytes: int,
        names: list[PageName] | None = None,
    ) -> None:
        call = EngineReportCall(tag, world, part, place, place_bytes, names or [])
        self._send(call, "report")

    def forget(self, tag: str, world: int, hashes: Sequence[bytes]) -> None:
        self._send(EngineForgetCall(tag, world, list(hashes)), "forget")

    def drop(self, tag: str, world: int, place: str, hashes: list[bytes], everything: bool) -> None:
        self._send(EngineDropCall(tag, world, place, hashes, everything), "drop")

    def hold(
        self, tag: str, world: int, chain: list[bytes], name: str, kind: str, ttl_s: float | None
    ) -> None:
        self._send(EngineHoldCall(tag, world, chain, name, kind, ttl_s), "hold")

    def release(self, tag: str, world: int, names: list[str], place: str) -> None:
        self._send(EngineLookupCall(tag, world, [], None, 0.0, names, place), "release")

    def settle(self, in_flight: int, deadline: float) -> None:
        """Take the replies that came; wait for more until no more than ``in_flight``
        calls are unanswered (raises ``TimeoutError`` past ``deadline``)."""
        while self.sent:
            wait = len(self.sent) > in_flight
            got = self._take(deadline) if wait else self._poll()
            if got is None:
                return

    def _send(self, call: msgspec.Struct, kind: str) -> int:
        seq = self.link.send(_ENCODE.encode(call))
        self.sent[seq] = kind
        return seq

    def _poll(self) -> tuple[int, bytes] | None:
        got = self.link.next_reply(0)
        return None if got is None else self._taken(*got)

    def _take(self, deadline: float) -> tuple[int, bytes]:
        left = deadline - self.clock()
        got = self.link.next_reply(max(left, 0.0)) if left > 0 else self.link.next_reply(0)
        if got is None:
            raise TimeoutError("the coordinator did not answer within the step's time")
        return self._taken(*got)

    def _taken(self, seq: int, payload: bytes | Exception) -> tuple[int, bytes]:
        kind = self.sent.pop(seq, None)
        if isinstance(payload, Exception):
            raise payload
        if kind == "report":
            self.orders += _REPORTED.decode(payload)[1]
        return seq, payload

    def close(self) -> None:
        self.link.close()
