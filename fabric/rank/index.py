"""What a rank's pages hold, kept by the rank itself, so a restarted coordinator
can adopt the L2 pages every rank still holds instead of starting empty.

Every whole page a rank computes into L1 is named by its namespace, its chain
hash (``fabric.cache.keys``: a hash of the whole prefix up to it), the chain
hash before it and its tokens; a copy to L2 or back carries the name with the
bytes. A slot's name is dropped *before* anything writes into the slot and set
again only once the write finished, so a name is never older than the bytes it
names: a slot being written, or written by a failed copy, has none. A freed slot
keeps its name until it is written again — its bytes are still that page, and a
coordinator that adopts it serves exactly those bytes.

Pages are hashed only when a new coordinator asks (``entries``): a compute
keeps its tokens once for all its pages. ``entries()`` lists the L2 slots with a name; a new coordinator adopts a slot
only where every rank names it alike (MIN over ranks again) and the tokens hash
to the name (``CoordinatorCore.adopt``). A prefetch from L3 names its pages too
(it carries their tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from fabric.cache.keys import chain_hashes


class PageName(NamedTuple):
    namespace: str
    chain_hash: bytes
    parent_hash: bytes
    tokens: bytes


class _Run:
    """Consecutive pages one command filled: their tokens, hashed only when a name
    is asked for (a new coordinator's inventory), not on every compute."""

    __slots__ = ("_hashes", "namespace", "page_bytes", "prev", "tokens")

    def __init__(self, namespace, prev, tokens, page_bytes, hashes=None) -> None:
        self.namespace, self.prev, self.tokens = namespace, prev, tokens
        self.page_bytes, self._hashes = page_bytes, hashes

    def hashes(self) -> list[bytes]:
        if self._hashes is None:
            self._hashes = chain_hashes(self.prev, self.tokens, self.page_bytes)
        return self._hashes


class PageRef:
    """Page ``i`` of a run: a ``PageName`` whose hashes are computed when read."""

    __slots__ = ("i", "run")

    def __init__(self, run: _Run, i: int) -> None:
        self.run, self.i = run, i

    @property
    def namespace(self) -> str:
        return self.run.namespace

    @property
    def chain_hash(self) -> bytes:
        return self.run.hashes()[self.i]

    @property
    def parent_hash(self) -> bytes:
        return self.run.hashes()[self.i - 1] if self.i else self.run.prev

    @property
    def tokens(self) -> bytes:
        pb = self.run.page_bytes
        return self.run.tokens[self.i * pb : (self.i + 1) * pb]


Name = PageName | PageRef


class _Mirrored(dict):
    """L2 names that a store outside the process keeps too (``SharedL2``): every
    name set or dropped here is set or dropped there."""

    def __init__(self, store: Any, names: dict[int, Name]) -> None:
        super().__init__(names)  # what the store already holds
        self.store = store

    def __setitem__(self, slot: int, name: Name) -> None:
        super().__setitem__(slot, name)
        self.store.put(slot, name.namespace, name.parent_hash, name.tokens)

    def pop(self, slot: int, *default: Any) -> Any:
        self.store.drop(slot)
        return super().pop(slot, *default)


class PageIndex:
    """The names of one rank's L1 and L2 page slots; with ``host_store``
    (``fabric.rank.shared_l2.SharedL2``), the L2 names live on outside the process
    and a new process starts with the ones it finds there."""

    def __init__(self, page_size: int, token_bytes: int = 4, host_store: Any = None) -> None:
        self.page_bytes = page_size * token_bytes
        self.device: dict[int, Name] = {}
        self.host: dict[int, Name] = (
            {} if host_store is None else _Mirrored(host_store, host_store.names())
        )

    def forget_device(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.device.pop(s, None)

    def forget_host(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.host.pop(s, None)

    def computed(self, namespace: str, prev: bytes, tokens: bytes, slots: Sequence[int]) -> None:
        """L1 ``slots`` now hold the KV of the packed ``tokens`` (one page each from
        the chain hash ``prev`` on; a partial last page gets no name)."""
        pb = self.page_bytes
        whole = min(len(slots), len(tokens) // pb)
        run = _Run(namespace, prev, tokens[: whole * pb], pb)
        for i in range(whole):
            self.device[slots[i]] = PageRef(run, i)
        self.forget_device(slots[whole:])

    def prefetched(self, cmd, first: int, n: int) -> None:
        """L2 slots ``cmd.host_pages[first : first + n]`` now hold those pages of a
        ``Prefetch`` that names its pages (namespace, hash before, tokens)."""
        run = _Run(cmd.namespace, cmd.prev_hash, cmd.tokens, self.page_bytes, cmd.page_hashes)
        for i in range(first, first + n):
            self.host[cmd.host_pages[i]] = PageRef(run, i)

    def copied(self, src: dict[int, Name], src_slots, dst: dict[int, Name], dst_slots):
        """A copy from ``src_slots`` to ``dst_slots`` finished: the names follow."""
        for s, d in zip(src_slots, dst_slots, strict=True):
            name = src.get(s)
            if name is None:
                dst.pop(d, None)
            else:
                dst[d] = name

    def entries(self) -> list[tuple[int, str, bytes, bytes, bytes]]:
        """Every named L2 slot: ``(slot, namespace, chain hash, parent hash, tokens)``."""
        return [
            (s, n.namespace, n.chain_hash, n.parent_hash, n.tokens) for s, n in self.host.items()
        ]
