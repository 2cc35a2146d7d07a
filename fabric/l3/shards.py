"""L3 keys spread over several storage actors (``storage.actors``).

Each page belongs to one storage actor, chosen from its chain hash by jump
consistent hashing (Lamping and Veach, "A Fast, Minimal Memory, Consistent Hash
Algorithm", 2014): a page's owner is a pure function of the hash and the number
of actors, and going from N to N+1 actors moves only a 1/(N+1) share of the
pages. Every actor opens the same backend (one shared store); ownership only
decides which actor indexes, hashes, reads and writes a page, so the actors
work on their shares at once.

- A hit query is led by one actor (the coordinator deals its queries out in
  turn): it hashes the prompt's chain (a client's hashes are never taken) and
  asks each owner about its pages (``shares``), its own included; each says
  where its first page that some rank's shard lacks is, and which of its
  positions hold every rank's hybrid components (``ShardAnswer``).
  ``merge_hits`` turns the answers into the one ``HitAnswer`` a single store
  would have given: the leading run is the MIN over actors, then the same walk
  back to an end whose components are all there. So each query is hashed
  once, and each actor checks only its own pages.
- A rank's loads, stores and locates are split by owner and sent at once
  (``ShardedLink``); a load's answer is the leading run of pages every owner
  returned, as from one store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from fabric.cache.controller import HitAnswer

T = TypeVar("T")

_MASK = (1 << 64) - 1


def jump_hash(key: int, buckets: int) -> int:
    """The bucket in ``0..buckets-1`` of the 64-bit ``key`` (Lamping and Veach)."""
    if buckets < 1:
        raise ValueError(f"buckets={buckets} is refused: allowed is an integer >= 1")
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _MASK
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def owner(page_hash: bytes, shards: int) -> int:
    """The storage actor that owns the page with this chain hash."""
    if shards == 1:
        return 0
    return jump_hash(int.from_bytes(page_hash[:8], "little"), shards)


def key_owner(key: str, shards: int) -> int:
    """The storage actor that owns the page an L3 key names (``page_key``: the
    chain hash's hex first)."""
    return owner(bytes.fromhex(key[:16]), shards)


def positions(page_hashes: Sequence[bytes], shards: int) -> list[list[int]]:
    """Per storage actor, the positions in ``page_hashes`` of the pages it owns
    (``owner`` of each, computed for all at once)."""
    if shards == 1:
        return [list(range(len(page_hashes)))]
    owners = jump_hashes(np.frombuffer(b"".join(h[:8] for h in page_hashes), dtype="<u8"), shards)
    order = np.argsort(owners, kind="stable")
    bounds = np.searchsorted(owners[order], np.arange(shards + 1))
    return [order[bounds[s] : bounds[s + 1]].tolist() for s in range(shards)]


def jump_hashes(keys: np.ndarray, buckets: int) -> np.ndarray:
    """``jump_hash`` of every 64-bit key at once (the same float arithmetic)."""
    key = keys.astype(np.uint64, copy=True)
    b = np.full(len(key), -1, dtype=np.int64)
    j = np.zeros(len(key), dtype=np.int64)
    live = np.arange(len(key))
    with np.errstate(over="ignore"):
        while len(live):
            b[live] = j[live]
            key[live] = key[live] * np.uint64(2862933555777941757) + np.uint64(1)
            span = float(1 << 31) / ((key[live] >> np.uint64(33)).astype(np.float64) + 1.0)
            j[live] = ((b[live] + 1).astype(np.float64) * span).astype(np.int64)
            live = live[j[live] < buckets]
    return b


# One storage actor's share of one hit query: the op id, the chain hashes of
# the pages it owns, their positions in the query, and the query's page count.
ShareQuery = tuple[int, list[bytes], list[int], int]


class ShardAnswer(NamedTuple):
    """One storage actor's answer to its share of a hit query. ``full``: the
    first position it owns whose page some rank's shard lacks (the query's
    length if none); ``mamba`` / ``sliding``: the positions it owns, before
    ``full``, whose component every rank's shard holds."""

    full: int
    mamba: Sequence[int] = ()
    sliding: Sequence[int] = ()


def shares(hashes_by_op: Mapping[int, Sequence[bytes]], shards: int) -> list[list[ShareQuery]]:
    """Per storage actor, its shares of the hit queries (``hashes_by_op``: each
    query's chain hashes): the pages it owns. An actor that owns no page of a
    query has no share of it, and puts no bound on its answer."""
    out: list[list[ShareQuery]] = [[] for _ in range(shards)]
    for op, hashes in hashes_by_op.items():
        for s, pos in enumerate(positions(hashes, shards)):
            if pos:
                out[s].append((op, [hashes[p] for p in pos], pos, len(hashes)))
    return out


def merge_shares(
    hashes_by_op: Mapping[int, Sequence[bytes]],
    answers: Sequence[Mapping[int, ShardAnswer]],
    parts: Sequence[str],
    window_pages: int,
) -> dict[int, HitAnswer]:
    """Every query's answer from the actors' answers to their shares
    (``merge_hits``), with the query's hashes."""
    out = {}
    for op, hashes in hashes_by_op.items():
        got = [a[op] for a in answers if op in a]
        out[op] = merge_hits(got, hashes, parts, window_pages) if got else HitAnswer(0, hashes)
    return out


def merge_hits(
    answers: Sequence[ShardAnswer],
    hashes: Sequence[bytes],
    parts: Sequence[str],
    window_pages: int,
) -> HitAnswer:
    """What one store would have answered: how many leading pages every rank's
    shard holds (the MIN over actors), and for a hybrid model the deepest of
    those page ends whose components are all there (the mamba state at the end,
    the sliding pages of the window before it)."""
    best = min(a.full for a in answers)
    if not parts or best == 0:
        return HitAnswer(best, hashes)
    mamba = set().union(*(a.mamba for a in answers))
    sliding = set().union(*(a.sliding for a in answers))

    def served(end: int) -> bool:
        if "mamba" in parts and end - 1 not in mamba:
            return False
        return "sliding" not in parts or all(
            p in sliding for p in range(max(0, end - window_pages), end)
        )

    end = best
    while end > 0 and not served(end):
        end -= 1
    return HitAnswer(end, hashes)


def leading(split: Sequence[Sequence[int]], got: Sequence[int], total: int) -> int:
    """How many leading positions of ``total`` are covered when actor ``s``
    returned the first ``got[s]`` of its positions ``split[s]``."""
    end = total
    for pos, n in zip(split, got, strict=True):
        if n < len(pos):
            end = min(end, pos[n])
    return end


def merge_rows(
    split: Sequence[Sequence[int]], rows: Sequence[np.ndarray], width: int
) -> np.ndarray:
    """One load's rows in the order asked, from each owner's leading rows: the
    leading run every owner returned (a row each), as one store's load."""
    total = sum(len(p) for p in split)
    end = leading(split, [len(r) for r in rows], total)
    out = np.empty((end, width), dtype=np.uint8)
    for pos, got in zip(split, rows, strict=True):
        n = sum(1 for p in pos[: len(got)] if p < end)  # positions are ascending
        if n:
            out[np.asarray(pos[:n])] = got[:n]
    return out


def merge_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The storage actors' figures as one store's: counters add up, and so do
    sizes each actor counts for its own pages; the size of a store every actor
    sees whole is the largest any actor saw; what is not a number (backend,
    write error) is the first actor's, or any actor's write error."""
    if len(stats) == 1:
        return dict(stats[0])
    # A store each actor sees whole (``L3Backend.sees_others``): its size is the
    # largest any actor saw. Else each actor counts its own pages: they add up.
    shared = {"pages", "bytes", "max_bytes", "files"} if stats[0].get("sees_others") else set()
    out: dict[str, Any] = {"attached": all(s.get("attached") for s in stats)}
    for s in stats:
        for key, value in s.items():
            if key == "attached":
                continue
            if key not in out:
                out[key] = value
            elif isinstance(value, bool) or not isinstance(value, int | float):
                if key == "write_error" and value and not out[key]:
                    out[key] = value
            elif key in shared:
                out[key] = max(out[key], value)
            else:
                out[key] += value
    out["actors"] = len(stats)
    return out


def union(lists: Iterable[Iterable[T]]) -> list[T]:
    """Every item of ``lists``, once, in first-seen order."""
    return list(dict.fromkeys(x for items in lists for x in items))


class ShardedLink:
    """A rank's way to L3 over several storage actors: each call is split by the
    pages' owners and sent to all of them before any answer is awaited (a link
    with ``start(method, *args)`` returns a waiter for its answer: a Ray call in
    flight; any other link is called in turn); the answers merge into what one
    store would have answered."""

    def __init__(self, links: Sequence[Any]) -> None:
        if not links:
            raise ValueError("a sharded link needs at least one storage link")
        self.links = list(links)
        self.shards = len(self.links)

    def _each(self, split: list[list[int]], method: str, *args: Any) -> list[Any]:
        """``link.method(*args(positions))`` for every shard that owns some
        positions, all sent before any is awaited; ``None`` for the others. An
        argument that is a callable is called with the shard's positions."""
        waiters: list[Callable[[], Any] | None] = []
        for link, pos in zip(self.links, split, strict=True):
            if not pos:
                waiters.append(None)
                continue
            call = [a(pos) if callable(a) else a for a in args]
            start = getattr(link, "start", None)
            if start is not None:
                waiters.append(start(method, *call))
            else:
                waiters.append(lambda link=link, call=call: getattr(link, method)(*call))
        return [None if w is None else w() for w in waiters]

    def load(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> np.ndarray:
        split = positions(page_hashes, self.shards)
        rows = self._each(split, "load", suffix, _pick(page_hashes), component)
        width = next((r.shape[1] for r in rows if r is not None), 0)
        empty = np.empty((0, width), dtype=np.uint8)
        return merge_rows(split, [empty if r is None else r for r in rows], width)

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool:
        split = positions(page_hashes, self.shards)
        done = self._each(
            split, "store", suffix, _pick(page_hashes), lambda pos: pages[pos], component
        )
        return all(bool(d) for d, pos in zip(done, split, strict=True) if pos)

    def locate(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> tuple[str, list[Any]] | None:
        """Where the leading pages found lie; ``None`` when an owner cannot say, or
        the owners' stores are not one directory."""
        split = positions(page_hashes, self.shards)
        found = self._each(split, "locate", suffix, _pick(page_hashes), component)
        answered = [f for f, pos in zip(found, split, strict=True) if pos]
        if any(f is None for f in answered) or len({f[0] for f in answered}) > 1:
            return None
        locs = [[] if f is None else f[1] for f in found]
        end = leading(split, [len(x) for x in locs], len(page_hashes))
        out: list[Any] = [None] * end
        for pos, got in zip(split, locs, strict=True):
            for p, loc in zip(pos, got, strict=False):
                if p < end:
                    out[p] = loc
        return (answered[0][0] if answered else ""), out

    def read_elsewhere(self, pages: int, refused: str | None = None) -> None:
        self.links[0].read_elsewhere(pages, refused)


def _pick(page_hashes: Sequence[bytes]) -> Callable[[list[int]], list[bytes]]:
    return lambda pos: [page_hashes[i] for i in pos]


class StorageShards:
    """``storage.actors`` storage services in one process, used as one
    (``LocalFabric``'s L3 when there are several): a hit query is hashed once
    and each owner asked about its pages, a rank's pages go to their owners
    (``ShardedLink``)."""

    def __init__(self, services: Sequence[Any]) -> None:
        self.services = list(services)
        self.link = ShardedLink(self.services)
        first = self.services[0]
        self.parts, self.window_pages = first.parts, first.window_pages
        self.suffixes = first.suffixes

    @property
    def backend(self) -> Any:
        return self.services[0].backend

    @property
    def spec(self) -> Any:
        return self.services[0].spec

    def key(self, page_hash: bytes, suffix: str, component: str = "full") -> str:
        return self.services[0].key(page_hash, suffix, component)

    def answer(self, prev: bytes, tokens: bytes, batch_pages: int = 128) -> HitAnswer:
        """Hashed once (as by the storage actor that leads the query), each
        shard's pages asked of their owner, the answers merged."""
        by_op = {0: self.services[0].hashes(prev, tokens)}
        split = shares(by_op, len(self.services))
        answers = [
            s.held(share, batch_pages) for s, share in zip(self.services, split, strict=True)
        ]
        return merge_shares(by_op, answers, self.parts, self.window_pages)[0]

    def load(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> np.ndarray:
        return self.link.load(suffix, page_hashes, component)

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool:
        return self.link.store(suffix, page_hashes, pages, component)

    def locate(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> tuple[str, list[Any]] | None:
        return self.link.locate(suffix, page_hashes, component)

    def read_elsewhere(self, pages: int, refused: str | None = None) -> None:
        self.link.read_elsewhere(pages, refused)

    def take_removed(self) -> list[bytes]:
        return union(s.take_removed() for s in self.services)

    def clear(self) -> bool:
        return all([s.clear() for s in self.services])

    def attach(self, name: str, extra: Mapping[str, Any]) -> str:
        outcomes = [s.attach(name, extra) for s in self.services]  # every one attaches
        return outcomes[0]

    def detach(self) -> bool:
        return any([s.detach() for s in self.services])

    def stats(self) -> dict[str, Any]:
        return merge_stats([s.stats() for s in self.services])
