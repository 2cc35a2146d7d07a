"""The coordinator's controller: tree calls become rank commands, batched per step.

Pools are symmetric, so the one pair of allocators here decides every rank's
slots, and every rank gets the same commands in the same order. Completions
come from consensus rounds: a rank's counters are cumulative within an epoch,
so the MIN over ranks minus what was already committed is what to commit now.

No message may exceed ``runtime.max_message_bytes``: an operation larger than
one command may carry is split into several commands (it completes when its
last one does, and fails if any of them fails), and each step sends only as
many queued commands as fit; the rest go with the next step, in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from fabric.cache.allocator import PagedAllocator
from fabric.cache.controller import (
    Completions,
    Controller,
    HitAnswer,
    PartCopy,
    StorageParts,
    as_answer,
)
from fabric.cache.keys import MAX_NAMESPACE_CHARS, TOKEN_BYTES, chain_hashes
from fabric.config import CacheConfig
from fabric.coordinator.consensus import Round
from fabric.errors import ConfigError
from fabric.messages import (
    Backup,
    Compute,
    Load,
    MambaPart,
    Message,
    Prefetch,
    SlidingPart,
    Write,
    command_bound,
    pages_per_command,
    parts_per_command,
)

# A hit query for the storage actor: ``(op_id, chain hash before, packed tokens)``;
# its answer: ``(hit pages, the pages' chain hashes)`` (``HitAnswer``).
Query = tuple[int, bytes, bytes]
Answer = HitAnswer | tuple[int, Sequence[bytes]]


class _OpQueue:
    """Commands of one kind in the order sent, each ``(cmd_id, op_id, last)``:
    an operation may span several commands; ``last`` marks its final one."""

    def __init__(self) -> None:
        self.entries: deque[tuple[int, int, bool]] = deque()
        self.committed = 0  # commands counted done so far in this epoch
        self._failing: set[int] = set()

    def add(self, cmd_ids: Sequence[int], op_id: int) -> None:
        for i, cmd in enumerate(cmd_ids):
            self.entries.append((cmd, op_id, i == len(cmd_ids) - 1))

    def oldest(self) -> int | None:
        return self.entries[0][0] if self.entries else None

    def commit(self, reported: int, failed: frozenset[int]) -> tuple[int, frozenset[int]]:
        """Commit up to ``reported`` commands counted done (a rank cannot have done
        more than was sent: a bogus count is clamped). Returns how many operations
        are now complete and which of them failed."""
        n = max(0, min(reported - self.committed, len(self.entries)))
        self.committed += n
        ops, bad = 0, set()
        for _ in range(n):
            cmd, op, last = self.entries.popleft()
            if cmd in failed:
                self._failing.add(op)
            if last:
                ops += 1
                if op in self._failing:
                    self._failing.discard(op)
                    bad.add(op)
        return ops, frozenset(bad)


class FabricController(Controller):
    def __init__(
        self,
        config: CacheConfig,
        max_message_bytes: int,
        with_prefix: bool = False,
        part_slots: int = 0,
    ) -> None:
        self.device = PagedAllocator(config.device_pages, config.page_size, "L1 device pool")
        self.host = PagedAllocator(config.host_pages, config.page_size, "L2 host pool")
        self.page_size = config.page_size
        # Commands get half of every message; its header (stops, forgets,
        # incarnations) the other half.
        self.command_budget = max_message_bytes // 2
        ns = MAX_NAMESPACE_CHARS
        # With ``with_prefix`` (a model filler) a compute also carries the tokens
        # before it: up to a whole L1 of them.
        self.with_prefix = with_prefix
        prefix_bytes = 0
        if with_prefix:  # its tokens, and one page index (a msgpack int) per page
            prefix_bytes = TOKEN_BYTES * config.device_tokens + 9 * config.device_pages
        self.compute_pages = pages_per_command(
            "compute", self.command_budget - prefix_bytes, self.page_size, ns
        )
        self.copy_pages = pages_per_command("copy", self.command_budget, self.page_size, ns)
        self.storage_pages = pages_per_command("storage", self.command_budget, self.page_size, ns)
        if self.compute_pages < 1:
            raise ConfigError(
                f"config runtime.max_message_bytes={max_message_bytes} is refused: a message "
                f"must hold the compute of one page of {self.page_size} tokens"
                + (
                    f" and a prefix of up to {config.device_tokens} (model.filler)"
                    if with_prefix
                    else ""
                )
                + f"; allowed is at least {2 * (prefix_bytes + 4 * self.page_size + 2048)}"
            )
        # A prefetch names its pages (their tokens travel with it), and a hybrid
        # model's carries up to ``part_slots`` component slots too.
        prefetch = pages_per_command("prefetch", self.command_budget, self.page_size, ns)
        self.max_prefetch_pages = max(1, prefetch - part_slots)
        # A hybrid model's component parts per command.
        self.part_count = parts_per_command(self.command_budget - prefix_bytes, self.page_size, ns)
        self.reset()

    def reset(self) -> None:
        self.device.reset()
        self.host.reset()
        self.outbox: deque[tuple[Message, int]] = deque()
        self._next_cmd = 0
        self.writes = _OpQueue()
        self.loads = _OpQueue()
        self.backups = _OpQueue()
        self.computes: deque[int] = deque()
        self.computes_counted = 0
        self.computes_committed = 0  # the highest compute cmd id committed
        self.queries: list[Query] = []
        self.stops: list[int] = []

    def _send(self, cmd: Message) -> None:
        self.outbox.append((cmd, command_bound(cmd)))

    def _cmd_id(self) -> int:
        self._next_cmd += 1
        return self._next_cmd

    def _copies(self, kind: type, op_id: int, src: Sequence[int], dst: Sequence[int]) -> list[int]:
        step = self.copy_pages
        cmds = []
        for start in range(0, max(len(src), 1), step):
            cmd = self._cmd_id()
            self._send(
                kind(cmd, tuple(src[start : start + step]), tuple(dst[start : start + step]))
            )
            cmds.append(cmd)
        return cmds

    def write(self, op_id, device_pages, host_pages, parts: PartCopy | None = None) -> None:
        cmds = self._copies(Write, op_id, device_pages, host_pages) + self._part_copies(
            Write, parts
        )
        self.writes.add(cmds, op_id)

    def load(self, op_id, host_pages, device_pages, parts: PartCopy | None = None) -> None:
        cmds = self._copies(Load, op_id, host_pages, device_pages) + self._part_copies(Load, parts)
        self.loads.add(cmds, op_id)

    def _part_copies(self, kind: type, parts: PartCopy | None) -> list[int]:
        """A hybrid model's component copies of one op, in commands of their own
        (the op completes, or fails, with all of them)."""
        if not parts:
            return []
        cmds, step = [], self.copy_pages
        pairs = [
            (parts.sliding_src[i : i + step], parts.sliding_dst[i : i + step], (), ())
            for i in range(0, len(parts.sliding_src), step)
        ] + [
            ((), (), parts.mamba_src[i : i + step], parts.mamba_dst[i : i + step])
            for i in range(0, len(parts.mamba_src), step)
        ]
        for s_src, s_dst, m_src, m_dst in pairs:
            cmd = self._cmd_id()
            self._send(kind(cmd, (), (), s_src, s_dst, m_src, m_dst))
            cmds.append(cmd)
        return cmds

    def compute(
        self,
        namespace: str,
        data: bytes,
        start_token: int,
        pages: Sequence[int],
        prev: bytes,
        prefix: bytes = b"",
        prefix_pages: Sequence[int] = (),
        sliding: Sequence[SlidingPart] = (),
        mamba: Sequence[MambaPart] = (),
        keep: int = 0,
        from_state: Sequence[int] = (),
        window: Sequence[int] = (),
    ) -> tuple[int, ...]:
        """Queue filling ``pages`` with the KV of the packed ``data``, the tokens from
        the page-aligned ``start_token`` on (the last page may be partial), in as
        many commands as the message limit needs (one, empty, when nothing is
        missing: it still orders the request after its loads). ``prev`` is the
        chain hash of the pages before ``start_token`` (the tree knows it): only
        the new pages are hashed, and only when a compute is cut in chunks.
        ``keep``: the first page already holds the KV of its first ``keep`` tokens.
        ``prefix``: the tokens before ``start_token``, and ``prefix_pages`` the L1
        pages of their KV, sent along ``with_prefix``. ``sliding`` and ``mamba``: a
        hybrid model's other components to store, in commands of their own after
        the tokens' (as many as the message limit needs), each token command
        naming the ends of the parts' pages in its span (``states_at``).
        ``from_state``: the L1 mamba slot of the state at ``start_token``, and
        ``window``: the L1 sliding pages of the window before it, for the first
        command. Returns the command ids."""
        ends = sorted({part.end_page for part in mamba} | {part.page + 1 for part in sliding})
        starts = {"keep": keep, "from_state": tuple(from_state), "window": tuple(window)}
        cmds = self._chunks(
            namespace, data, start_token, pages, prev, prefix, prefix_pages, ends, starts
        )
        # A model filler computes the parts from every token up to the fill's end.
        upto = prefix + data if self.with_prefix else b""
        n = self.part_count
        for i in range(0, len(sliding), n):
            part = tuple(sliding[i : i + n])
            cmds.append(self._parts(namespace, prev, start_token, upto, part, ()))
        for i in range(0, len(mamba), n):
            part = tuple(mamba[i : i + n])
            cmds.append(self._parts(namespace, prev, start_token, upto, (), part))
        return tuple(cmds)

    def _chunks(
        self,
        namespace: str,
        data: bytes,
        start_token: int,
        pages: Sequence[int],
        prev: bytes,
        prefix: bytes,
        prefix_pages: Sequence[int],
        ends: list[int],
        starts: dict,
    ) -> list[int]:
        """``compute``'s token commands: ``starts``, the fields of the first only;
        each names the ``ends`` in its span (``states_at``)."""
        pb = self.page_size * TOKEN_BYTES
        step = self.compute_pages
        whole = len(data) - len(data) % pb
        hashes = chain_hashes(prev, data[:whole], pb) if len(pages) > step else []
        cmds = []
        for offset in range(0, max(len(pages), 1), step):
            chunk = tuple(pages[offset : offset + step])
            chain = hashes[offset - 1] if offset else prev
            tokens = data[offset * pb : (offset + len(chunk)) * pb]
            before, held = b"", ()
            if self.with_prefix:
                before = prefix + data[: offset * pb]
                held = tuple(prefix_pages) + tuple(pages[:offset])
            first = start_token + offset * self.page_size
            page = first // self.page_size
            states_at = tuple(e for e in ends if page < e <= page + len(chunk))
            cmd = self._cmd_id()
            only = starts if offset == 0 else {}
            self._send(
                Compute(
                    cmd,
                    namespace,
                    chain,
                    tokens,
                    first,
                    chunk,
                    before,
                    held,
                    states_at=states_at,
                    **only,
                )
            )
            self.computes.append(cmd)
            cmds.append(cmd)
        return cmds

    def _parts(self, namespace, prev, start_token, upto, sliding, mamba) -> int:
        cmd = self._cmd_id()
        self._send(Compute(cmd, namespace, prev, b"", start_token, (), upto, (), sliding, mamba))
        self.computes.append(cmd)
        return cmd

    def backup(
        self,
        op_id: int,
        host_pages: Sequence[int],
        page_hashes: Sequence[bytes],
        parts: StorageParts | None = None,
    ) -> None:
        step, cmds = self.storage_pages, []
        for start in range(0, max(len(host_pages), 1), step):
            cmd = self._cmd_id()
            self._send(
                Backup(
                    cmd,
                    tuple(host_pages[start : start + step]),
                    tuple(page_hashes[start : start + step]),
                )
            )
            cmds.append(cmd)
        if parts:  # a hybrid model's components: a command of their own in the same op
            sliding = list(zip(parts.sliding_pages, parts.sliding_hashes, strict=True))
            mamba = list(zip(parts.mamba_slots, parts.mamba_hashes, strict=True))
            half = max(1, step // 2)  # sliding and mamba entries share a command
            for start in range(0, max(len(sliding), len(mamba)), half):
                s, m = sliding[start : start + half], mamba[start : start + half]
                cmd = self._cmd_id()
                self._send(
                    Backup(
                        cmd,
                        (),
                        (),
                        tuple(p for p, _ in s),
                        tuple(h for _, h in s),
                        tuple(p for p, _ in m),
                        tuple(h for _, h in m),
                    )
                )
                cmds.append(cmd)
        self.backups.add(cmds, op_id)

    def query_storage(self, op_id: int, prev: bytes, tokens: bytes) -> None:
        self.queries.append((op_id, prev, tokens))

    def prefetch(
        self,
        op_id: int,
        host_pages: Sequence[int],
        page_hashes: Sequence[bytes],
        parts: StorageParts | None = None,
        names: tuple[str, bytes, bytes] | None = None,
    ) -> None:
        assert len(host_pages) <= self.max_prefetch_pages, "the cache caps prefetches"
        p = parts or StorageParts()
        namespace, prev, tokens = names or ("", b"", b"")
        self._send(
            Prefetch(
                self._cmd_id(),
                op_id,
                tuple(host_pages),
                tuple(page_hashes),
                namespace,
                prev,
                tokens,
                p.sliding_pages,
                p.sliding_hashes,
                p.mamba_slots,
                p.mamba_hashes,
            )
        )

    def stop_prefetch(self, op_id: int) -> None:
        self.stops.append(op_id)

    def take_commands(self) -> tuple[Message, ...]:
        """The oldest queued commands that fit in one message's command budget."""
        out, used = [], 0
        while self.outbox and used + self.outbox[0][1] <= self.command_budget:
            cmd, size = self.outbox.popleft()
            out.append(cmd)
            used += size
        return tuple(out)

    def take_stops(self, limit: int) -> tuple[int, ...]:
        out, self.stops = tuple(self.stops[:limit]), self.stops[limit:]
        return out

    def take_queries(self) -> list[Query]:
        out, self.queries = self.queries, []
        return out

    def take_completions(self) -> Completions:
        return Completions()

    def acked(self) -> int:
        """The highest command id up to which every counted command is committed."""
        oldest = [q.oldest() for q in (self.writes, self.loads, self.backups)]
        oldest.append(self.computes[0] if self.computes else None)
        pending = [c for c in oldest if c is not None]
        return (min(pending) if pending else self._next_cmd + 1) - 1

    def busy(self) -> bool:
        return bool(
            self.outbox
            or self.writes.entries
            or self.loads.entries
            or self.computes
            or self.backups.entries
            or self.queries
            or self.stops
        )

    def completions(self, rnd: Round, storage_hits: Mapping[int, Answer]) -> Completions:
        """What to commit after a usable round (and the storage actor's answers to
        the hit queries: hit counts, already MIN over shards, and the pages'
        hashes); advances the committed counts."""
        assert rnd.computes_done is not None and rnd.writes_done is not None
        assert rnd.loads_done is not None
        failed = rnd.failed
        writes, failed_writes = self.writes.commit(rnd.writes_done, failed)
        loads, failed_loads = self.loads.commit(rnd.loads_done, failed)
        backups, failed_backups = self.backups.commit(rnd.backups_done or 0, failed)
        n = max(0, min(rnd.computes_done - self.computes_counted, len(self.computes)))
        self.computes_counted += n
        computes = [self.computes.popleft() for _ in range(n)]
        if computes:
            self.computes_committed = computes[-1]
        return Completions(
            writes=writes,
            failed_writes=failed_writes,
            loads=loads,
            failed_loads=failed_loads,
            computes=n,
            failed_computes=frozenset(cmd for cmd in computes if cmd in failed),
            backups=backups,
            failed_backups=failed_backups,
            prefetch_hits={op: as_answer(a) for op, a in storage_hits.items()},
            prefetch_progress=rnd.prefetch_progress,
            prefetch_terminated=rnd.prefetch_terminated,
            prefetch_released=rnd.prefetch_finished,
        )
