"""Engine pages: the coordinator's index of what engines attached through a
connector (``fabric.engines.vllm_connector``) have stored, shard by shard.

An engine of ``world`` ranks (TP times PP) stores each page of a prompt as ``world``
shard pages in L3, one per rank, each under its own key. A rank reports the
pages it stored; a page is *whole* — visible to lookups — only once every one of
the ``world`` ranks reported it: the MIN over ranks, as for the fabric's own
ranks. Pages are named by their chain hash (``fabric.cache.keys``), which names
the whole prefix before the page, so a request's chain of hashes is its path in
the tree and the longest run of whole pages from the first is its match.

Entries are grouped by the engine's page provenance tag and ``world``: two
engine configurations never see each other's pages. At most ``capacity``
entries (whole or reported by some ranks only) are kept, the least recently
used forgotten first; forgetting an entry deletes nothing from L3, it only ends
later matches before that page (nor is it an event: the page is still in L3).
A page a rank failed to load is forgotten at once (``forget``, a
``BlockRemoved``), so it is matched again only after a rank stores it anew.

A lookup may lease what it matched, under a name (the engine and request): a
leased page is not forgotten to make room until every lease on it is released
(the request's pages are loaded) or has expired (``lease_s``), so the answer
an engine acts on stays true while it loads. A page that failed to load is
forgotten even when leased: its bytes are gone or bad.
Nothing here imports Ray: the coordinator actor turns calls into these methods.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from fabric.cache.events import BlockRemoved, BlockStored, KVEvent, Medium
from fabric.cache.keys import check_namespace
from fabric.errors import InvalidInput

HASH_BYTES = 32
MAX_WORLD = 4096
# Pages one chain or run may name (a 2M-token prompt at 32-token pages is 65,536),
# and chains or runs one call may carry (an engine step's requests).
MAX_PAGES_PER_CALL = 1 << 17
MAX_CHAINS_PER_CALL = 1 << 12
# Leases held at once (the oldest ends first beyond), their longest life, and
# the longest lease name (an engine's id and a request id).
MAX_LEASES = 1 << 16
MAX_LEASE_S = 600.0
MAX_LEASE_NAME = 256
_TAG = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class StoredRun:
    """Pages one rank stored, in chain order: ``hashes`` follow the page hashed
    ``parent`` (``None``: they start ``namespace``'s chain)."""

    namespace: str
    parent: bytes | None
    hashes: tuple[bytes, ...]


@dataclass
class _Entry:
    namespace: str
    reported: int  # bit r: rank r reported the page
    leases: int = 0  # leases held on it


@dataclass
class EnginePageStats:
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages: int = 0
    reported_pages: int = 0
    whole_pages: int = 0
    forgotten_pages: int = 0
    evicted_pages: int = 0
    leases: int = 0
    leases_released: int = 0
    leases_expired: int = 0


class EnginePages:
    def __init__(self, capacity: int = 1 << 20) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity {capacity!r} is refused: allowed is an int >= 1")
        self.capacity = capacity
        self.stats = EnginePageStats()
        self._entries: OrderedDict[tuple[str, int, bytes], _Entry] = OrderedDict()
        # Lease name -> (expiry, the entries it holds), oldest first.
        self._leases: OrderedDict[str, tuple[float, list[_Entry]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def leased(self) -> int:
        """Leases held now."""
        return len(self._leases)

    def lookup(
        self,
        tag: str,
        world: int,
        chains: Sequence[Sequence[bytes]],
        leases: Sequence[str] | None = None,
        lease_s: float = 0.0,
        now: float = 0.0,
    ) -> list[int]:
        """Per chain (one request's page hashes, in order): how many leading pages
        are whole. The pages matched become the most recently used. With
        ``leases`` (a name per chain) and ``lease_s`` > 0, each chain's matched
        pages are leased under its name until ``release`` or ``now + lease_s``."""
        _check_group(tag, world)
        self.expire(now)
        if leases is not None:
            _check_leases(leases, chains, lease_s)
        if not isinstance(chains, (list, tuple)) or len(chains) > MAX_CHAINS_PER_CALL:
            raise InvalidInput(
                f"chains must be a list of at most {MAX_CHAINS_PER_CALL} page-hash lists, "
                f"got {type(chains).__name__} of {len(chains) if hasattr(chains, '__len__') else '?'}"
            )
        for chain in chains:
            _check_hashes(chain, "chain")
        full = (1 << world) - 1
        entries = self._entries
        out = []
        for i, chain in enumerate(chains):
            self.stats.lookups += 1
            self.stats.lookup_pages += len(chain)
            held: list[_Entry] = []
            for page_hash in chain:
                key = (tag, world, page_hash)
                entry = entries.get(key)
                if entry is None or entry.reported != full:
                    break
                entries.move_to_end(key)
                held.append(entry)
            self.stats.hit_pages += len(held)
            out.append(len(held))
            if leases is not None and held and lease_s > 0:
                self._lease(leases[i], held, now + lease_s)
        return out

    def _lease(self, name: str, held: list[_Entry], until: float) -> None:
        self.release([name])  # a name leases once: a new lookup under it replaces it
        for entry in held:
            entry.leases += 1
        self._leases[name] = (until, held)
        self.stats.leases += 1
        while len(self._leases) > MAX_LEASES:
            self._end(next(iter(self._leases)))
            self.stats.leases_expired += 1

    def release(self, names: Sequence[str]) -> int:
        """End the leases ``names`` (unknown or ended ones are skipped); how many
        ended."""
        if not isinstance(names, (list, tuple)) or len(names) > MAX_CHAINS_PER_CALL:
            raise InvalidInput(
                f"lease names are refused: allowed is a list of at most {MAX_CHAINS_PER_CALL}"
            )
        ended = 0
        for name in names:
            if isinstance(name, str) and name in self._leases:
                self._end(name)
                ended += 1
        self.stats.leases_released += ended
        return ended

    def expire(self, now: float) -> int:
        """End the leases whose time is up at ``now``; how many."""
        expired = [name for name, (until, _) in self._leases.items() if until <= now]
        for name in expired:
            self._end(name)
        self.stats.leases_expired += len(expired)
        return len(expired)

    def _end(self, name: str) -> None:
        _, held = self._leases.pop(name)
        for entry in held:
            entry.leases -= 1

    def report(
        self, tag: str, world: int, reports: dict[int, Sequence[StoredRun]]
    ) -> list[KVEvent]:
        """Record, per rank, the pages it stored; ``BlockStored`` events (medium
        storage) for the pages this made whole, one per run that completed some."""
        _check_group(tag, world)
        if not isinstance(reports, dict):
            raise InvalidInput(f"reports must map a rank to its stored runs, got {type(reports)}")
        full = (1 << world) - 1
        events: list[KVEvent] = []
        for rank, runs in reports.items():
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
                raise InvalidInput(f"rank {rank!r} is refused: allowed is an int in [0, {world})")
            if not isinstance(runs, (list, tuple)) or len(runs) > MAX_CHAINS_PER_CALL:
                raise InvalidInput(
                    f"rank {rank}'s runs are refused: allowed is a list of at most "
                    f"{MAX_CHAINS_PER_CALL} stored runs"
                )
            for run in runs:
                _check_run(run)
        for rank, runs in reports.items():
            bit = 1 << rank
            for run in runs:
                whole: list[bytes] = []
                before = start = run.parent
                for page_hash in run.hashes:
                    entry = self._touch(tag, world, page_hash, run.namespace)
                    became_whole = False
                    if not entry.reported & bit:
                        entry.reported |= bit
                        self.stats.reported_pages += 1
                        became_whole = entry.reported == full
                    if became_whole:
                        if not whole:
                            start = before
                        whole.append(page_hash)
                    elif whole:  # a run of pages made whole ended
                        events.append(_stored(run.namespace, start, whole))
                        whole = []
                    before = page_hash
                if whole:
                    events.append(_stored(run.namespace, start, whole))
        self.stats.whole_pages += sum(len(e.page_hashes) for e in events)
        self._evict()
        return events

    def forget(self, tag: str, world: int, hashes: Sequence[bytes]) -> list[KVEvent]:
        """Drop ``hashes`` (a rank could not load them: gone from L3, or refused by
        its checks); a ``BlockRemoved`` (medium storage) per namespace for the
        pages that were whole."""
        _check_group(tag, world)
        _check_hashes(hashes, "hashes")
        full = (1 << world) - 1
        removed: dict[str, list[bytes]] = {}
        for page_hash in hashes:
            entry = self._entries.pop((tag, world, page_hash), None)
            if entry is None:
                continue
            self.stats.forgotten_pages += 1
            if entry.reported == full:
                removed.setdefault(entry.namespace, []).append(page_hash)
        return [BlockRemoved(tuple(h), Medium.STORAGE, ns) for ns, h in removed.items()]

    def clear(self) -> None:
        """Forget every entry (L3 was cleared) and every lease."""
        self._entries.clear()
        self._leases.clear()

    def _touch(self, tag: str, world: int, page_hash: bytes, namespace: str) -> _Entry:
        key = (tag, world, page_hash)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(namespace, 0)
        else:
            self._entries.move_to_end(key)
        return entry

    def _evict(self) -> None:
        """Forget the least recently used entries beyond ``capacity``; a leased one
        is kept (made most recent) while its lease holds."""
        over = len(self._entries) - self.capacity
        looked = 0
        while over > 0 and looked < len(self._entries):
            key, entry = self._entries.popitem(last=False)
            if entry.leases > 0:
                self._entries[key] = entry
                looked += 1
                continue
            over -= 1
            self.stats.evicted_pages += 1


def _stored(namespace: str, parent: bytes | None, hashes: list[bytes]) -> BlockStored:
    return BlockStored(tuple(hashes), Medium.STORAGE, namespace, parent)


def _check_group(tag: object, world: object) -> None:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise InvalidInput(f"tag {tag!r} is refused: allowed is 16 lowercase hex digits")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD:
        raise InvalidInput(f"world {world!r} is refused: allowed is an int in [1, {MAX_WORLD}]")


def _check_hashes(hashes: object, what: str) -> None:
    if not isinstance(hashes, (list, tuple)) or len(hashes) > MAX_PAGES_PER_CALL:
        raise InvalidInput(
            f"{what} is refused: allowed is a list of at most {MAX_PAGES_PER_CALL} page hashes"
        )
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise InvalidInput(f"page hash {h!r:.80} is refused: allowed is {HASH_BYTES} bytes")


def _check_leases(leases: object, chains: Sequence, lease_s: object) -> None:
    if not isinstance(leases, (list, tuple)) or len(leases) != len(chains):
        raise InvalidInput(
            f"leases are refused: allowed is one lease name per chain ({len(chains)})"
        )
    for name in leases:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LEASE_NAME:
            raise InvalidInput(
                f"lease name {name!r:.80} is refused: allowed is a str of 1..{MAX_LEASE_NAME} "
                f"characters"
            )
    if (
        not isinstance(lease_s, (int, float))
        or isinstance(lease_s, bool)
        or not 0 <= lease_s <= MAX_LEASE_S
    ):
        raise InvalidInput(
            f"lease_s {lease_s!r} is refused: allowed is a number in [0, {MAX_LEASE_S:g}]"
        )


def _check_run(run: object) -> None:
    if not isinstance(run, StoredRun):
        raise InvalidInput(f"a stored run must be a StoredRun, got {type(run).__name__}")
    try:
        check_namespace(run.namespace)
    except InvalidInput as exc:
        raise InvalidInput(f"stored run: {exc}") from None
    if run.parent is not None and (not isinstance(run.parent, bytes) or len(run.parent) != 32):
        raise InvalidInput(f"parent {run.parent!r:.80} is refused: allowed is 32 bytes or None")
    _check_hashes(run.hashes, "hashes")
