"""How a vLLM worker's pages move between its KV blocks and the fabric's tiers.

A page is one block of every layer of this rank. A load finds each page in the
node's L2 (checked in place, then copied from shared memory into the blocks one
layer at a time) or reads it from L3 into a page buffer (checked as every L3
read is) and copies it from there; a store gathers the blocks a layer at a time
into a page buffer. ``fetch``, ``scatter_layer`` and ``settle`` are the three
steps of a load, so that a load can run layer by layer while the forward runs
(``fabric.engines.vllm_worker``). Page buffers are kept and reused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fabric.cache.engine_input import StoredRun
from fabric.engines.store import PageStore
from fabric.engines.vllm_pages import PageLoad, Placement
from fabric.errors import ConfigError
from fabric.l3.format import Provenance, page_key
from fabric.rank.node_l2 import NodeL2

log = logging.getLogger(__name__)

# Bytes of pages one load or store stages at once (at least one page).
STAGING_BYTES = 64 << 20
# Page buffers kept for reuse once given back.
MAX_FREE_BUFFERS = 8
MAX_FREE_BYTES = 8 * STAGING_BYTES
# How long a load holds the node L2's slots it found at most (it lets go once copied).
L2_PIN_MS = 5000
# How long a page stored in the node's L2 only (write-back: not in L3 yet) is held
# there at most, against the region's own replacement, until the fabric copies it.
WRITE_BACK_HOLD_MS = 600_000


# Takes pages read from L3 to keep in the node's L2: (tag, run, keys, pages, their
# buffer, given back once done).
Promoter = Callable[[str, StoredRun, list[str], torch.Tensor, torch.Tensor], None]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _bytes(rows: torch.Tensor):
    """A host tensor of blocks (one a row) as ``numpy`` bytes, one block a row."""
    return rows.view(torch.uint8).view(rows.shape[0], -1).numpy()


def block_rows(
    name: str, kv: torch.Tensor | None, num_blocks: int, block_bytes: int
) -> torch.Tensor:
    """Layer ``name``'s KV cache ``kv`` viewed as one row of ``block_bytes`` worth of
    elements per block: a block's bytes are contiguous, blocks ``stride(0)``
    apart (a state's blocks are padded to the pool's page size: only their
    content is a page's)."""
    if not isinstance(kv, torch.Tensor):
        raise ConfigError(f"layer {name!r} has no KV cache tensor (got {type(kv).__name__})")
    inner = kv.dim() > 1 and kv.shape[0] == num_blocks and kv[0].is_contiguous()
    if not (kv.is_contiguous() and kv.shape[0] % num_blocks == 0) and not inner:
        raise ConfigError(
            f"layer {name!r}: KV cache of shape {tuple(kv.shape)} (contiguous: "
            f"{kv.is_contiguous()}) does not hold {num_blocks} blocks at dimension 0"
        )
    if kv.is_contiguous():
        rows = kv.view(num_blocks, -1)
    else:  # a view, never a copy: writes to it are writes to the pool
        rows = kv.as_strided((num_blocks, kv[0].numel()), (kv.stride(0), 1))
    row_bytes = rows.shape[1] * kv.element_size()
    if row_bytes != block_bytes:
        raise ConfigError(
            f"layer {name!r}: a block holds {row_bytes} bytes, but the KV cache spec "
            f"declares {block_bytes} (heads per rank x block size x K and V head sizes x "
            f"dtype size, or a state's shapes): the declared geometry is not this rank's pool"
        )
    return rows


@dataclass(frozen=True)
class L2Options:
    """The node's L2 for this engine's pages (``fabric.rank.node_l2``)."""

    max_bytes: int
    directory: str = ""  # empty: the node's shared memory
    fabric: str = ""  # the fabric the pages belong to: its runtime.name
    ray_namespace: str = ""  # and its Ray namespace


@dataclass
class Fetched:
    """A job's pages found (in the node's L2) or read (from L3 into page buffers),
    not yet in their blocks: ``parts`` in order."""

    parts: list[tuple[str, list, tuple[int, ...]]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    l2: int = 0  # pages found in the node's L2
    pinned: list = field(default_factory=list)  # its slots this load holds
    raced: bool = False  # a node L2 slot was rewritten while copied: no verdict on the page
    late: bool = False  # an L3 read was not started past the load's limit: no verdict either

    @property
    def checked(self) -> bool:
        """Whether the first page not fetched was found missing or bad (a verdict)."""
        return not self.raced and not self.late


class Cancelled(Exception):
    """A load was given up on (it took longer than the step may wait): its blocks
    are not written any more."""


class LoadGuard:
    """What a load thread holds while it writes blocks: once ``cancel`` returns,
    no block is written by it again (vLLM may have given them to another request)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True


class PageMoves:
    """This rank's blocks (``layers``: one row of bytes-worth of elements per
    block, a tensor per layer), its L3 store and its node L2. ``provenance`` is
    the rank's pages' (set once its KV cache is known)."""

    def __init__(self, placement: Placement, block_bytes: int) -> None:
        self.provenance: Provenance | None = None
        self.placement = placement
        self.block_bytes = block_bytes
        self.layers: list[torch.Tensor] = []
        self.store: PageStore | None = None
        self.l2: NodeL2 | None = None
        self.l2_place = ""  # the node's L2 as the fabric's tree names it (none: "")
        # Whether a store writes L3 at once (else the node's L2 only, when there is
        # one: the fabric's tree orders the copy to L3 later).
        self.write_through = True
        self._free: dict[int, list[torch.Tensor]] = {}  # page buffers not in use, by rows
        self._free_bytes = 0
        self._buffers = threading.Lock()
        # Takes pages read from L3 (tag, run, keys, pages, their buffer) to keep in
        # the node's L2 later, giving the buffer back once done.
        self.promoter: Promoter | None = None

    def keys(self, tag: str, hashes: tuple[bytes, ...]) -> list[str]:
        suffix = self.placement.suffix
        return [page_key(h, tag, suffix) for h in hashes]

    def buffer(self, rows: int | None = None) -> torch.Tensor:
        """A page buffer of at least ``rows`` rows of ``page_bytes`` (``batch_pages``
        by default) to fill: the next power of two, so that buffers are kept and
        reused by size (a new one costs its pages' first touch); give it back with
        ``give``. Safe from any thread, in inference mode or not: a buffer is never
        an inference tensor (one made in vLLM's forward, reused on the writer
        thread for an order's copy, would refuse the copy)."""
        size = self.batch_pages if rows is None else min(_pow2(rows), self.batch_pages)
        with self._buffers:
            free = self._free.get(size)
            if free:
                self._free_bytes -= free[-1].numel()
                return free.pop()
        with torch.inference_mode(False):
            return torch.empty((size, self.page_bytes), dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._buffers:
            free = self._free.setdefault(buffer.shape[0], [])
            if len(free) < MAX_FREE_BUFFERS and self._free_bytes + buffer.numel() <= MAX_FREE_BYTES:
                free.append(buffer)
                self._free_bytes += buffer.numel()

    def sync(self) -> None:
        """Wait until the copies into the blocks queued on this thread are done: on a
        GPU they run on this thread's stream, which vLLM's forward (on a stream of
        its own) does not wait for; a layer is released only once in place."""
        if self.layers and self.layers[0].device.type == "cuda":
            torch.cuda.current_stream(self.layers[0].device).synchronize()

    def load_one(
        self, job: PageLoad, guard: LoadGuard, deadline: float | None = None
    ) -> tuple[int, int, bool]:
        """Read the job's leading pages into their blocks, a batch at a time, while
        ``guard`` is not cancelled (and no L3 read past ``deadline``); how many, how
        many of them came from the node's L2, and whether the first not read was
        found missing or bad (else: a slot of the node's L2 rewritten while copied,
        or the deadline passed — no verdict on the page)."""
        if not self.layers:
            return 0, 0, False
        done = l2 = 0
        for start in range(0, len(job.hashes), self.batch_pages):
            end = min(start + self.batch_pages, len(job.hashes))
            f = self.fetch(job, start, end, deadline)
            try:
                with guard.lock:
                    if guard.cancelled:
                        raise Cancelled
                    for layer in range(len(self.layers)):
                        self.scatter_layer(f, layer)
                    self.sync()
                n = self.settle(f)
            finally:
                self.release(f)
            done += n
            l2 += f.l2
            if n < end - start:
                return done, l2, f.checked
        return done, l2, True

    def fetch(
        self, job: PageLoad, start: int = 0, end: int | None = None, deadline: float | None = None
    ) -> Fetched:
        """Find the job's leading pages ``[start, end)``: those the node's L2 holds
        (checked in place), the others read from L3 into page buffers (none once
        ``deadline`` has passed); the first that is neither ends it."""
        assert self.provenance is not None
        end = len(job.hashes) if end is None else end
        block_ids = job.block_ids[start:end]
        keys = self.keys(job.tag, job.hashes[start:end])
        f = Fetched()
        if not self.layers:
            return f
        found: list = [None] * len(keys)
        if self.l2 is not None:
            found = self.l2.find(keys, pin_ms=L2_PIN_MS)  # held until copied
            f.pinned = [x for x in found if x is not None]
        i = 0
        while i < len(keys):
            if found[i] is not None:
                j = i
                while j < len(keys) and found[j] is not None and self.l2.check(found[j]):
                    j += 1
                if j > i:
                    f.parts.append(("l2", found[i:j], block_ids[i:j]))
                    f.l2 += j - i
                if j < len(keys) and found[j] is not None:
                    found[j] = None  # it failed its check: L3 may hold it whole
                i = j
                continue
            j = i
            while j < len(keys) and found[j] is None and j - i < self.batch_pages:
                j += 1
            if self.store is None:
                return f
            if deadline is not None and time.monotonic() > deadline:
                f.late = True
                return f
            buffer = self.buffer(j - i)
            f.buffers.append(buffer)
            n = self.store.load(keys[i:j], buffer[: j - i].numpy(), self.provenance)
            if n:
                run = (job.tag, job.run(start + i, start + i + n))
                source = [buffer[:n], keys[i : i + n], buffer, run]
                f.parts.append(("l3", source, block_ids[i : i + n]))
            if n < j - i:
                return f
            i = j
        return f

    def scatter_layer(self, f: Fetched, layer: int) -> None:
        """Copy layer ``layer`` of every fetched page into its block."""
        rows = self.layers[layer]
        lo, hi = layer * self.block_bytes, (layer + 1) * self.block_bytes
        for kind, source, block_ids in f.parts:
            if kind == "l2" and rows.device.type == "cpu":
                # numpy's copy of one block: ~1 us a call and no thread pool to
                # start (torch's took 4-5x longer on blocks of tens of KiB).
                assert self.l2 is not None
                pool, blocks = self.l2.pool.numpy(), _bytes(rows)
                for (slot, *_), block in zip(source, block_ids, strict=True):
                    blocks[block] = pool[slot, lo:hi]
            elif kind == "l2":
                assert self.l2 is not None
                pool = self.l2.pool
                for (slot, *_), block in zip(source, block_ids, strict=True):
                    rows[block].copy_(pool[slot, lo:hi].view(rows.dtype))
            else:
                part = source[0][:, lo:hi].view(rows.dtype).to(rows.device, non_blocking=True)
                index = torch.tensor(block_ids, dtype=torch.long, device=rows.device)
                rows.index_copy_(0, index, part)

    def settle(self, f: Fetched) -> int:
        """How many of the fetched pages are in their blocks as they were checked:
        a page of the node's L2 rewritten while it was copied ends the run."""
        n = 0
        for kind, source, block_ids in f.parts:
            if kind == "l2":
                assert self.l2 is not None
                for found in source:
                    if not self.l2.unchanged(found):
                        f.raced = True
                        return n
                    n += 1
            else:
                n += len(block_ids)
                self._promote(f, source)
        return n

    def _promote(self, f: Fetched, source: list) -> None:
        pages, keys, buffer, (tag, run) = source
        if self.l2 is None or self.promoter is None or not len(pages):
            return
        f.buffers = [b for b in f.buffers if b is not buffer]  # the promoter gives it back
        self.promoter(tag, run, keys, pages, buffer)

    def release(self, f: Fetched) -> None:
        for buffer in f.buffers:
            self.give(buffer)
        f.buffers = []
        if f.pinned and self.l2 is not None:
            self.l2.unpin(f.pinned)
            f.pinned = []

    def gather_layer(self, pages: torch.Tensor, block_ids: tuple[int, ...], layer: int) -> None:
        """Copy layer ``layer`` of the blocks into ``pages`` (one page a row)."""
        rows = self.layers[layer]
        index = torch.tensor(block_ids, dtype=torch.long)
        part = pages[:, layer * self.block_bytes : (layer + 1) * self.block_bytes]
        part = part.view(rows.dtype)
        if rows.device.type == "cpu":
            torch.index_select(rows, 0, index, out=part)
        else:
            part.copy_(rows.index_select(0, index.to(rows.device)))

    def l2_put(self, keys: list[str], pages: torch.Tensor, hold: bool = False) -> list[bool]:
        """Per page, whether the node's L2 holds it now (none without one); ``hold``:
        held there until copied to L3 (``WRITE_BACK_HOLD_MS`` at most)."""
        if self.l2 is None:
            return []
        try:
            return self.l2.put(keys, pages, WRITE_BACK_HOLD_MS if hold else 0)
        except Exception as exc:  # the node's L2 is a cache: a page not kept is a miss
            log.warning("kvfabric connector: node L2 store failed: %s", exc)
            return [False] * len(keys)

    @property
    def page_bytes(self) -> int:
        return self.block_bytes * len(self.layers)

    @property
    def batch_pages(self) -> int:
        return max(1, STAGING_BYTES // max(self.page_bytes, 1))
