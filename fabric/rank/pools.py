"""One rank's KV pools (its shard of every page) and page copies between them.

A pool is one tensor in one of three layouts; every layout is also seen
through the same canonical view ``(2, pages, page_tokens, layers, heads,
head_dim)`` (K/V first), so copies and token writes are written once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fabric.config import ModelConfig
from fabric.topology import Shard

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MAX_SLICE_RUNS = 16
# Between two host pools pages move a run at a time however scattered (one
# strided copy each: a gather into a temporary and a scatter out of it copy every
# byte twice), by numpy (~1 us a call, without the GIL; torch's strided copy
# costs ~5 us a call). From this many bytes a copy, torch's threads share the
# runs (a thread's part at least a few pages: bench/datapath.py --page-kib).
_SHARED_COPY_BYTES = 4 << 20
# Rows of bytes move to and from a host pool a page (or run) at a time from
# this many bytes a page; smaller ones by one index copy.
_SLICE_PAGE_BYTES = 64 << 10


def pick_device(preference: str) -> torch.device:
    """``cuda`` when asked for or when ``auto`` finds a GPU, else ``cpu``."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class KVPool:
    """``num_pages`` pages of one shard's KV in ``layout`` on ``device``."""

    def __init__(
        self,
        num_pages: int,
        shard: Shard,
        model: ModelConfig,
        device: torch.device,
        pin_memory: bool = False,
        layers: int | None = None,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        """``layers``: how many of the shard's layers the pool holds (default all; a
        hybrid model's full-attention and sliding pools each hold their kind's).
        ``allocate(shape, dtype)``: the pool's memory from elsewhere (a shared L2,
        ``fabric.rank.shared_l2``) instead of a new zeroed tensor."""
        self.num_pages = num_pages
        self.layout = model.layout
        pt, heads, dim = shard.page_tokens, shard.heads, model.head_dim
        layers = shard.layers if layers is None else layers
        shape = {
            "layer_first": (2, layers, num_pages * pt, heads, dim),
            "page_first": (2, num_pages * pt, layers, heads, dim),
            "page_first_direct": (2, num_pages, layers, pt, heads, dim),
        }[model.layout]
        self.buffer = (
            torch.zeros(shape, dtype=DTYPES[model.dtype], device=device, pin_memory=pin_memory)
            if allocate is None
            else allocate(shape, DTYPES[model.dtype])
        )
        b = self.buffer
        if model.layout == "layer_first":
            view = b.view(2, layers, num_pages, pt, heads, dim).permute(0, 2, 3, 1, 4, 5)
        elif model.layout == "page_first":
            view = b.view(2, num_pages, pt, layers, heads, dim)
        else:
            view = b.permute(0, 1, 3, 2, 4, 5)
        self.pages = view  # (2, pages, page_tokens, layers, heads, head_dim)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def write_tokens(
        self, pages: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``values`` ``(2, T, layers, heads, head_dim)`` at token ``offsets`` of ``pages``."""
        self.pages[:, pages, offsets] = values.to(self.buffer.device, self.buffer.dtype)

    def read_tokens(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.pages[:, pages, offsets]

    def copy_to(self, dst: KVPool, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        copy_pages(self, src_pages, dst, dst_pages)

    def rows(self, pages: Sequence[int]):
        return pages_to_bytes(self, pages)

    def put_rows(self, pages: Sequence[int], rows) -> None:
        bytes_to_pages(self, pages, rows)


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both sides advance by one page."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_pages(
    src: KVPool,
    src_pages: Sequence[int],
    dst: KVPool,
    dst_pages: Sequence[int],
) -> None:
    """Copy pages between pools of the same shard. Contiguous runs move as slices;
    scattered pages in one gather/scatter."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"copy of {len(src_pages)} pages into {len(dst_pages)}")
    if not src_pages:
        return
    runs = page_runs(src_pages, dst_pages)
    s_view, d_view = src.pages, dst.pages
    on_host = src.buffer.device.type == dst.buffer.device.type == "cpu"
    if on_host:
        _copy_runs(_byte_pages(src), _byte_pages(dst), runs, _page_bytes(src))
    elif len(runs) <= _MAX_SLICE_RUNS:
        for s, d, n in runs:
            d_view[:, d : d + n].copy_(s_view[:, s : s + n], non_blocking=True)
    else:
        device = dst.buffer.device
        s_idx = torch.as_tensor(src_pages, dtype=torch.long, device=src.buffer.device)
        d_idx = torch.as_tensor(dst_pages, dtype=torch.long, device=device)
        d_view[:, d_idx] = s_view[:, s_idx].to(device, non_blocking=True)


def _copy_runs(src: np.ndarray, dst: np.ndarray, runs: list, page_bytes: int) -> None:
    """Copy ``runs`` (``page_runs``) of ``src``'s pages into ``dst`` (byte views of
    host pools), shared among torch's threads when the copy is large."""

    def copy(part: list) -> None:
        for s, d, n in part:
            dst[:, d : d + n] = src[:, s : s + n]

    total = sum(n for _, _, n in runs) * page_bytes
    threads = min(torch.get_num_threads(), len(runs), max(1, total // _SHARED_COPY_BYTES))
    if threads <= 1:
        copy(runs)
        return
    pool = _copy_pool(threads - 1)
    step = -(-len(runs) // threads)  # each thread a stretch of runs: streams the prefetcher follows
    parts = [runs[i : i + step] for i in range(0, len(runs), step)]
    others = [pool.submit(copy, part) for part in parts[1:]]
    try:
        copy(parts[0])
    finally:
        for other in others:
            other.result()


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _copy_pool(workers: int) -> ThreadPoolExecutor:
    """The threads (made once per count) that share large host copies."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, "kvfabric-copy")
        return pool


def _page_bytes(pool: KVPool) -> int:
    return pool.buffer.numel() // max(pool.num_pages, 1) * pool.buffer.element_size()


def _page_at_a_time(pool: KVPool) -> bool:
    """Whether rows move to and from ``pool`` one strided copy a page (large pages
    on the host: near memcpy speed) rather than one gather or scatter by index."""
    return pool.buffer.device.type == "cpu" and _page_bytes(pool) >= _SLICE_PAGE_BYTES


def pages_to_bytes(pool: KVPool, pages: Sequence[int]):
    """Pages as rows of bytes (``numpy`` uint8, one row per page) in the canonical
    order ``(2, page_tokens, layers, heads, head_dim)`` whatever the layout."""
    pages = list(pages)
    if _page_at_a_time(pool):
        out = np.empty((len(pages), _page_bytes(pool)), dtype=np.uint8)
        src, dst = _byte_pages(pool), _canonical(pool, out)
        for s, d, n in page_runs(pages, range(len(pages))):
            dst[:, d : d + n] = src[:, s : s + n]
        return out
    else:
        idx = torch.as_tensor(pages, dtype=torch.long, device=pool.buffer.device)
        rows = pool.pages[:, idx].permute(1, 0, 2, 3, 4, 5).contiguous().cpu()
    row_bytes = rows[0].numel() * rows.element_size() if len(pages) else 0
    return rows.view(torch.uint8).reshape(len(pages), row_bytes).numpy()


def bytes_to_pages(pool: KVPool, pages: Sequence[int], rows) -> None:
    """Store rows from ``pages_to_bytes`` (possibly a read-only buffer) into ``pages``."""
    import warnings

    n = len(pages)
    if not memoryview(rows).nbytes:
        return  # a stage without layers of this kind: empty pages
    if _page_at_a_time(pool):
        src = _canonical(pool, np.frombuffer(rows, dtype=np.uint8).reshape(n, -1))
        dst = _byte_pages(pool)
        for s, d, k in page_runs(range(n), pages):
            dst[:, d : d + k] = src[:, s : s + k]
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only object-store buffers: we only read
        flat = torch.frombuffer(memoryview(rows).cast("B"), dtype=torch.uint8)
    shape = (n, 2, *pool.pages.shape[2:])
    values = flat.view(pool.buffer.dtype).view(shape).permute(1, 0, 2, 3, 4, 5)
    idx = torch.as_tensor(list(pages), dtype=torch.long, device=pool.buffer.device)
    pool.pages[:, idx] = values.to(pool.buffer.device)


def _byte_pages(pool: KVPool) -> np.ndarray:
    """A host pool's canonical view as ``numpy`` bytes (its last axis the head's
    bytes): numpy copies a strided page with little per-call overhead and
    without the GIL."""
    view = pool.__dict__.get("_byte_pages")
    if view is None:
        view = pool.__dict__["_byte_pages"] = pool.pages.view(torch.uint8).numpy()
    return view


def _canonical(pool: KVPool, rows: np.ndarray) -> np.ndarray:
    """``rows`` (a page a row) seen as ``_byte_pages`` sees the pool: K/V first."""
    shape = (len(rows), 2, *_byte_pages(pool).shape[2:])
    return rows.reshape(shape).transpose(1, 0, 2, 3, 4, 5)


class StatePool:
    """A hybrid model's mamba states on one rank: ``slots`` states of its
    ``layers`` mamba layers, ``elems`` float32 values each (its share of a
    layer's state)."""

    def __init__(self, slots: int, layers: int, elems: int, device: torch.device) -> None:
        self.num_slots = slots
        self.buffer = torch.zeros((slots, layers, elems), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def copy_to(self, dst: StatePool, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        src_idx = torch.as_tensor(list(src_slots), dtype=torch.long, device=self.buffer.device)
        dst_idx = torch.as_tensor(list(dst_slots), dtype=torch.long, device=dst.buffer.device)
        dst.buffer[dst_idx] = self.buffer[src_idx].to(dst.buffer.device)

    def rows(self, slots: Sequence[int]):
        return state_rows(self, slots)

    def put_rows(self, slots: Sequence[int], rows) -> None:
        rows_to_states(self, slots, rows)


def state_rows(pool: StatePool, slots: Sequence[int]):
    """Mamba states as rows of bytes (``numpy`` uint8, one row per slot)."""
    idx = torch.as_tensor(list(slots), dtype=torch.long, device=pool.buffer.device)
    rows = pool.buffer[idx].contiguous().cpu()
    row_bytes = rows[0].numel() * rows.element_size() if len(slots) else 0
    return rows.view(torch.uint8).reshape(len(slots), row_bytes).numpy()


def rows_to_states(pool: StatePool, slots: Sequence[int], rows) -> None:
    """Store rows from ``state_rows`` (possibly a read-only buffer) into ``slots``."""
    import warnings

    if not memoryview(rows).nbytes:
        return  # a stage without mamba layers: empty states
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only object-store buffers: we only read
        flat = torch.frombuffer(memoryview(rows).cast("B"), dtype=torch.uint8)
    values = flat.view(torch.float32).view((len(slots), *pool.buffer.shape[1:]))
    idx = torch.as_tensor(list(slots), dtype=torch.long, device=pool.buffer.device)
    pool.buffer[idx] = values.to(pool.buffer.device)


class Pool(Protocol):
    """What a rank does with any of its pools: copy slots into another pool of the
    same kind, and read or write slots as rows of bytes (L3's pages)."""

    buffer: torch.Tensor

    @property
    def nbytes(self) -> int: ...

    def copy_to(self, dst, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None: ...

    def rows(self, slots: Sequence[int]): ...

    def put_rows(self, slots: Sequence[int], rows) -> None: ...


@dataclass
class Tiers:
    """One component's pools: L1 on the rank's device, L2 in (pinned) host memory."""

    device: Pool
    host: Pool

    def copy(self, src: Sequence[int], dst: Sequence[int], to_host: bool) -> None:
        """Copy slots L1 -> L2 (``to_host``) or L2 -> L1."""
        if to_host:
            self.device.copy_to(self.host, src, dst)
        else:
            self.host.copy_to(self.device, src, dst)


class RankPools:
    """A rank's pools by component: ``full`` (every full-attention layer), and a
    hybrid model's ``sliding`` (the sliding-window layers' pages) and ``mamba``
    (the mamba layers' states)."""

    def __init__(self) -> None:
        self.by_component: dict[str, Tiers] = {}

    def add(self, component: str, device: Pool, host: Pool) -> Tiers:
        self.by_component[component] = tiers = Tiers(device, host)
        return tiers

    def __getitem__(self, component: str) -> Tiers:
        tiers = self.by_component.get(component)
        if tiers is None:
            raise ValueError(f"{component} slots for a model without {component} layers")
        return tiers

    def device(self, component: str) -> Pool | None:
        """``component``'s L1 pool, or ``None`` for a model without it."""
        tiers = self.by_component.get(component)
        return None if tiers is None else tiers.device
