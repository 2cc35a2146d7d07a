"""A paged slot allocator for one tier's pool.

Pools are symmetric across ranks, so one allocator in the coordinator decides
every rank's slots. Units are pages; slot ``s`` of page ``p`` is
``p * page_size + s``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from fabric.errors import InvalidInput


class PagedAllocator:
    """Hands out page indices in ``[0, num_pages)``; lowest free pages first.

    ``alloc`` returns ``None`` when fewer pages are free than asked for (an
    expected refusal). ``free`` of a page that is already free, out of range or
    repeated raises ``InvalidInput`` and frees nothing.
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
        return len(self._free_stack)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def alloc(self, num_pages: int) -> tuple[int, ...] | None:
        if num_pages < 0:
            raise InvalidInput(f"{self.name}: cannot allocate {num_pages} pages")
        if num_pages > len(self._free_stack):
            return None
        if num_pages == 0:
            return ()
        pages = self._free_stack[-num_pages:]
        del self._free_stack[-num_pages:]
        pages.reverse()
        self._free_set.difference_update(pages)
        return tuple(pages)

    def free(self, pages: Sequence[int]) -> None:
        # Validated with C-level set and array operations: frees can be thousands of
        # pages when a long L2 leaf is evicted.
        try:
            packed = array("q", pages)
        except (TypeError, OverflowError):
            bad = next((p for p in pages if not isinstance(p, int)), pages)
            raise InvalidInput(f"{self.name}: page {bad!r} is not a page of this pool") from None
        if not packed:
            return
        if min(packed) < 0 or max(packed) >= self.num_pages:
            bad = next(p for p in packed if not 0 <= p < self.num_pages)
            raise InvalidInput(f"{self.name}: page {bad!r} is not a page of this pool")
        unique = set(packed)
        if len(unique) != len(packed) or not unique.isdisjoint(self._free_set):
            seen: set[int] = set()
            bad = next(p for p in packed if p in self._free_set or p in seen or seen.add(p))
            raise InvalidInput(f"{self.name}: double free of page {bad}")
        self._free_set.update(unique)
        # Keep low pages on top of the stack so reuse is deterministic and compact.
        self._free_stack.extend(sorted(unique, reverse=True))

    def is_free(self, page: int) -> bool:
        return page in self._free_set

    def reset(self) -> None:
        self._free_stack: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._free_set: set[int] = set(range(self.num_pages))

    def slots(self, pages: Iterable[int]) -> list[int]:
        """Token slot indices of ``pages``, in order."""
        size = self.page_size
        return [p * size + s for p in pages for s in range(size)]
