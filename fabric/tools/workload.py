"""Workloads: the Mooncake trace format, a synthetic conversation generator, the
mapping from block hash ids to token ids, and ``drive``, which replays packed
prompts through a running fabric with a window in flight (results in
completion order: a request waiting for L1 room must not wait behind leases
this driver has not yet released).

A request names its prompt as a run of block ids; each id stands for a fixed
block of ``BLOCK_TOKENS`` token ids, the same every run, so two requests that
share leading ids share that prefix.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from fabric.cache.keys import TOKEN_BYTES
from fabric.cache.results import TierTokens
from fabric.errors import FabricError, InvalidInput

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# Ids and lengths fit a signed 64-bit integer (they become numpy int64 and token
# ids); a trace line is a JSON object with these fields (others are ignored).
_MAX = 2**63 - 1


class TraceRow(msgspec.Struct, forbid_unknown_fields=False):
    """One line of a Mooncake-format trace, as a schema: whole numbers only (no
    ``true``, no ``1.5``, no ``"12"``), none negative or past int64."""

    input_length: Annotated[int, msgspec.Meta(ge=0, le=_MAX)]
    hash_ids: list[Annotated[int, msgspec.Meta(ge=0, le=_MAX)]]
    timestamp: Annotated[int, msgspec.Meta(ge=0, le=_MAX)] = 0
    output_length: Annotated[int, msgspec.Meta(ge=0, le=_MAX)] = 0


_decode_row = msgspec.json.Decoder(TraceRow).decode


def read_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Requests of a Mooncake-format JSONL trace (``TraceRow`` per line);
    ``InvalidInput`` naming the file, the line and the field at fault."""
    out = []
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; bytes: decoded per line
    except OSError as exc:
        raise InvalidInput(f"trace {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = _decode_row(line)
            except msgspec.ValidationError as exc:
                raise InvalidInput(f"{path}:{lineno}: not a trace request: {exc}") from None
            except msgspec.DecodeError as exc:
                why = str(exc) if line.isascii() or _utf8(line) else "not UTF-8 text"
                raise InvalidInput(f"{path}:{lineno}: not a JSON object: {why[:120]}") from None
            out.append(
                Request(row.timestamp, row.input_length, row.output_length, tuple(row.hash_ids))
            )
    return out


def _utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def synthetic_trace(num_requests: int, seed: int = 0) -> list[Request]:
    """Multi-turn chats over a few shared system prompts: each turn re-sends the
    whole conversation so far plus a new user message."""
    rng = random.Random(seed)
    next_id = iter(range(10**9))
    prompts = [[next(next_id) for _ in range(rng.randint(1, 4))] for _ in range(8)]
    sessions: list[list[int]] = []
    out = []
    for i in range(num_requests):
        if not sessions or rng.random() < 0.3:
            sessions.append(list(rng.choice(prompts)))
            if len(sessions) > 32:
                sessions.pop(0)
        history = rng.choice(sessions)
        history.extend(next(next_id) for _ in range(rng.randint(1, 2)))
        length = (len(history) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        out.append(Request(i * 100, length, rng.randint(16, 512), tuple(history)))
        history.append(next(next_id))
    return out


class BlockTokens:
    """Token ids of requests, block by block; a block's tokens depend only on its id."""

    def __init__(self, seed: int = 0, block_tokens: int = BLOCK_TOKENS) -> None:
        self.seed = seed.to_bytes(8, "little")
        self.block_bytes = block_tokens * TOKEN_BYTES

    def block(self, hash_id: int) -> bytes:
        return hashlib.shake_128(self.seed + hash_id.to_bytes(8, "little")).digest(self.block_bytes)

    def packed(self, request: Request) -> bytes:
        """The request's prompt as packed uint32 tokens (``fabric.cache.keys`` format)."""
        data = b"".join(self.block(h) for h in request.hash_ids)
        return data[: request.input_length * TOKEN_BYTES]


def iter_packed(requests: list[Request], seed: int = 0) -> Iterator[tuple[Request, bytes]]:
    blocks = BlockTokens(seed)
    for r in requests:
        yield r, blocks.packed(r)


def iter_turns(
    requests: list[Request], seed: int = 0
) -> Iterator[tuple[Request, bytes, bytes, bool]]:
    """Each request's prompt and the answer it got, packed, and whether a next
    turn of its conversation follows.

    A request's next turn is the first later one whose blocks extend all of its
    whole blocks and whose prompt is no shorter. The next turn's prompt holds
    this one's prompt and answer verbatim (a block id stands for a whole block,
    which in the next turn has the answer in it), so both are cut from the last
    turn of the chain: the answer is the ``output_length`` tokens after the
    prompt, as far as the next prompt reaches. A request with no next turn gets
    an answer of fresh tokens that nothing reuses.
    """
    n = len(requests)
    succ: list[int | None] = [None] * n
    open_turns: dict[tuple[int, ...], int] = {}  # whole blocks -> a turn without a next one
    for i, r in enumerate(requests):
        h = r.hash_ids
        for cut in range(len(h) - 1, 0, -1):
            p = open_turns.get(h[:cut])
            if p is not None and requests[p].input_length <= r.input_length:
                succ[p] = i
                del open_turns[h[:cut]]
                break
        if len(h) > 1:
            open_turns[h[:-1]] = i
    blocks = BlockTokens(seed)
    last, last_tokens = -1, b""
    for i, r in enumerate(requests):
        t = i
        while (later := succ[t]) is not None:
            t = later
        if t != last:
            last, last_tokens = t, b"".join(blocks.block(h) for h in requests[t].hash_ids)
        start = r.input_length * TOKEN_BYTES
        prompt = last_tokens[:start]
        nxt = succ[i]
        if nxt is None:
            answer = hashlib.shake_128(b"answer" + i.to_bytes(8, "little") + blocks.seed).digest(
                r.output_length * TOKEN_BYTES
            )
        else:
            end = min(r.input_length + r.output_length, requests[nxt].input_length)
            answer = last_tokens[start : end * TOKEN_BYTES]
        yield r, prompt, answer, nxt is not None


@dataclass
class DriveStats:
    latencies_s: list[float] = field(default_factory=list)
    tokens: TierTokens = field(default_factory=TierTokens)
    refused: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def percentile_ms(self, q: float) -> float | None:
        xs = sorted(self.latencies_s)
        return round(1000 * xs[int(q * (len(xs) - 1))], 2) if xs else None


def drive(
    fabric: Any,
    prompts: Iterable[bytes],
    inflight: int = 8,
    on_done: Callable[[int], None] | None = None,
) -> DriveStats:
    """Submit every prompt (packed tokens), keep at most ``inflight`` pending,
    release each lease as soon as its result arrives."""
    stats = DriveStats()
    pending: dict[Any, float] = {}
    done = 0
    started = time.perf_counter()

    def collect_one() -> None:
        nonlocal done
        ready, _ = fabric.wait(list(pending))
        for ref in ready:
            t0 = pending.pop(ref)
            try:
                result = fabric.result(ref)
            except FabricError as exc:
                stats.refuse(str(exc))
            else:
                if result.error:
                    stats.refuse(result.error)
                else:
                    stats.latencies_s.append(time.perf_counter() - t0)
                    stats.tokens.add(
                        result.device_hit_tokens,
                        result.host_hit_tokens,
                        result.storage_hit_tokens,
                        result.computed_tokens,
                    )
                    fabric.release(result.lease)
            done += 1
            if on_done is not None:
                on_done(done)

    limit = fabric.config.cache.device_tokens
    for packed in prompts:
        if len(packed) // 4 > limit:
            stats.refuse(f"larger than L1 ({limit} tokens; raise cache.device_tokens)")
            done += 1
            if on_done is not None:
                on_done(done)
            continue
        pending[fabric.submit_async(packed)] = time.perf_counter()
        while len(pending) >= inflight:
            collect_one()
    while pending:
        collect_one()
    stats.elapsed_s = time.perf_counter() - started
    return stats
