"""A paged slot allocator for one tier's pool, and ``Pages``, the page lists the
cache keeps.

Pools are symmetric across ranks, so one allocator in the coordinator decides
every rank's slots. Units are pages; slot ``s`` of page ``p`` is
``p * page_size + s``. A list of pages is an ``array('q')`` (``Pages``): the
tree slices, joins and frees runs of thousands of pages per request, which
as arrays are memory copies and vector operations rather than per-page
Python objects.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from fabric.errors import InvalidInput

Pages = array  # of typecode "q": page indices


def as_pages(items: Iterable[int] = ()) -> Pages:
    """``items`` as ``Pages`` (no copy when they already are)."""
    if type(items) is array and items.typecode == "q":  # type: ignore[attr-defined]
        return items  # type: ignore[return-value]
    return array("q", items)


class PagedAllocator:
    """Hands out page indices in ``[0, num_pages)``: the free pages are a stack, at
    first in ascending order; a free pushes its pages so that the next
    allocation returns them in the order they were freed: recently freed pages
    are reused first (as in SGLang's allocator).

    ``alloc`` returns ``None`` when fewer pages are free than asked for (an
    expected refusal). ``free`` of a page that is already free, out of range or
    repeated raises ``InvalidInput`` and frees nothing.

    The stack is a numpy array beside a per-page free flag: an allocation or a
    free of thousands of pages (a long leaf evicted) is a few vector
    operations, checks included, not a Python loop. Memory: 17 bytes a page.
    """

    def __init__(self, num_pages: int, page_size: int, name: str = "pool") -> None:
        if num_pages < 0 or page_size < 1:
            raise InvalidInput(f"{name}: num_pages={num_pages}, page_size={page_size} refused")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.reset()

    @property
    def available_pages(self) -> int:
        return self._top

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def alloc(self, num_pages: int) -> Pages | None:
        if num_pages < 0:
            raise InvalidInput(f"{self.name}: cannot allocate {num_pages} pages")
        if num_pages > self._top:
            return None
        if num_pages == 0:
            return array("q")
        top = self._top - num_pages
        out = self._stack[top : self._top][::-1]
        self._top = top
        self._is_free[out] = False
        return array("q", out.tobytes())

    def free(self, freed: Sequence[int]) -> None:
        """Return ``freed`` to the pool, refusing (freeing nothing) when any page is out
        of range, free already or repeated."""
        packed = self._checked(freed)
        n = len(packed)
        if n > 1:
            # A repeated page keeps only its last position in the scratch array.
            positions = self._positions[:n]
            self._scratch[packed] = positions
            if np.count_nonzero(self._scratch[packed] != positions):
                self._refuse(freed)
        self._push(packed)

    def release(self, owned: Sequence[int]) -> None:
        """``free`` for pages the tree owned (a node's, or all of one eviction's
        victims'): still refused when out of range or free already (a double
        free), not checked for repeats within (``check_integrity`` counts every
        owned page)."""
        self._push(self._checked(owned))

    def _checked(self, freed: Sequence[int]) -> np.ndarray:
        # Vector operations, no sort (argmin, argmax and count_nonzero are the
        # cheap ones: a free runs once per evicted node).
        try:
            packed = np.frombuffer(as_pages(freed), dtype=np.int64)
        except (TypeError, OverflowError):
            bad = next((p for p in freed if not isinstance(p, int)), freed)
            raise InvalidInput(f"{self.name}: page {bad!r} is not a page of this pool") from None
        if len(packed) and (
            packed[packed.argmin()] < 0
            or packed[packed.argmax()] >= self.num_pages
            or np.count_nonzero(self._is_free[packed])
        ):
            self._refuse(freed)
        return packed

    def _push(self, packed: np.ndarray) -> None:
        # The next allocation hands them out in the order they were freed.
        n = len(packed)
        self._is_free[packed] = True
        self._stack[self._top : self._top + n] = packed[::-1]
        self._top += n

    def violations(self) -> list[str]:
        """What is wrong with the free stack (for ``check_integrity``): every stacked
        page flagged free, as many flags as stacked pages (so none stacked twice)."""
        stacked = self._stack[: self._top]
        out = []
        if not self._is_free[stacked].all():
            out.append(f"{self.name}: a stacked page is not flagged free")
        if int(np.count_nonzero(self._is_free)) != self._top:
            out.append(
                f"{self.name}: {int(np.count_nonzero(self._is_free))} pages flagged free, "
                f"{self._top} stacked"
            )
        return out

    def _refuse(self, freed: Sequence[int]) -> None:
        """Raise ``InvalidInput`` naming the first page of ``freed`` that is out of
        range, already free or repeated."""
        seen: set[int] = set()
        for p in freed:
            if not 0 <= p < self.num_pages:
                raise InvalidInput(f"{self.name}: page {p!r} is not a page of this pool")
            if self._is_free[p] or p in seen:
                raise InvalidInput(f"{self.name}: double free of page {p}")
            seen.add(p)
        raise AssertionError("no bad page found")

    def take(self, pages: Sequence[int]) -> None:
        """Allocate exactly ``pages`` (each free, none repeated): a restarted
        coordinator taking back the pages the ranks still hold."""
        packed = np.frombuffer(as_pages(pages), dtype=np.int64)
        if len(packed) == 0:
            return
        if (
            packed.min() < 0
            or packed.max() >= self.num_pages
            or not self._is_free[packed].all()
            or len(np.unique(packed)) != len(packed)
        ):
            raise InvalidInput(f"{self.name}: pages to take must be free and distinct")
        self._is_free[packed] = False
        stacked = self._stack[: self._top]
        keep = stacked[self._is_free[stacked]]
        self._top = len(keep)
        self._stack[: self._top] = keep

    def is_free(self, page: int) -> bool:
        return 0 <= page < self.num_pages and bool(self._is_free[page])

    def reset(self) -> None:
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._top = self.num_pages
        self._is_free = np.ones(self.num_pages, dtype=bool)
        self._scratch = np.zeros(self.num_pages, dtype=np.int32)
        self._positions = np.arange(self.num_pages, dtype=np.int32)

    def slots(self, pages: Iterable[int]) -> list[int]:
        """Token slot indices of ``pages``, in order."""
        size = self.page_size
        return [p * size + s for p in pages for s in range(size)]
