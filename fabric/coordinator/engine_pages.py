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


@dataclass
class EnginePageStats:
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages: int = 0
    reported_pages: int = 0
    whole_pages: int = 0
    forgotten_pages: int = 0
    evicted_pages: int = 0


class EnginePages:
    def __init__(self, capacity: int = 1 << 20) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity {capacity!r} is refused: allowed is an int >= 1")
        self.capacity = capacity
        self.stats = EnginePageStats()
        self._entries: OrderedDict[tuple[str, int, bytes], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tag: str, world: int, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """Per chain (one request's page hashes, in order): how many leading pages
        are whole. The pages matched become the most recently used."""
        _check_group(tag, world)
        if not isinstance(chains, (list, tuple)) or len(chains) > MAX_CHAINS_PER_CALL:
            raise InvalidInput(
                f"chains must be a list of at most {MAX_CHAINS_PER_CALL} page-hash lists, "
                f"got {type(chains).__name__} of {len(chains) if hasattr(chains, '__len__') else '?'}"
            )
        full = (1 << world) - 1
        entries = self._entries
        out = []
        for chain in chains:
            _check_hashes(chain, "chain")
            self.stats.lookups += 1
            self.stats.lookup_pages += len(chain)
            hit = 0
            for page_hash in chain:
                key = (tag, world, page_hash)
                entry = entries.get(key)
                if entry is None or entry.reported != full:
                    break
                entries.move_to_end(key)
                hit += 1
            self.stats.hit_pages += hit
            out.append(hit)
        return out

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
        """Forget every entry (L3 was cleared)."""
        self._entries.clear()

    def _touch(self, tag: str, world: int, page_hash: bytes, namespace: str) -> _Entry:
        key = (tag, world, page_hash)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(namespace, 0)
        else:
            self._entries.move_to_end(key)
        return entry

    def _evict(self) -> None:
        over = len(self._entries) - self.capacity
        for _ in range(max(over, 0)):
            self._entries.popitem(last=False)
        self.stats.evicted_pages += max(over, 0)


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
