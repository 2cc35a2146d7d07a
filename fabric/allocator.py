"""A paged slot allocator for one tier's pool.

Pools are symmetric across ranks, so one allocator in the coordinator decides
every rank's slots. Units are pages; slot ``s`` of page ``p`` is
``p * page_size + s``.
"""

from __future__ import annotations

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
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_pages)

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
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return tuple(pages)

    def free(self, pages: Sequence[int]) -> None:
        is_free = self._is_free
        seen: set[int] = set()
        for p in pages:
            if not (isinstance(p, int) and 0 <= p < self.num_pages):
                raise InvalidInput(f"{self.name}: page {p!r} is not a page of this pool")
            if is_free[p] or p in seen:
                raise InvalidInput(f"{self.name}: double free of page {p}")
            seen.add(p)
        for p in pages:
            is_free[p] = 1
        # Keep low pages on top of the stack so reuse is deterministic and compact.
        self._free_stack.extend(sorted(pages, reverse=True))

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> Iterable[int]:
        return (p for p in range(self.num_pages) if self._is_free[p])

    def reset(self) -> None:
        self._free_stack = list(range(self.num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * self.num_pages)

    def slots(self, pages: Iterable[int]) -> list[int]:
        """Token slot indices of ``pages``, in order."""
        size = self.page_size
        return [p * size + s for p in pages for s in range(size)]
