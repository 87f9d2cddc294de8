"""KV page allocator (host side, no JAX): the pool pages a sequence owns, lowest free id first;
`NULL_PAGE` is never handed out. Source: nano-vllm / vLLM's block manager, no prefix caching."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.engine.sequence import Sequence

NULL_PAGE = 0  # the reserved page padding points at (the one definition)


class BlockManager:
    """Free list of pages ``1 .. num_pages - 1``. Raises ValueError: ``num_pages`` not an
    integer >= 2, ``page_size`` not >= 1."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        for name, v, lo, why in (("num_pages", num_pages, 2, " (page 0 is the reserved null page)"),
                                 ("page_size", page_size, 1, "")):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"BlockManager.{name}={v!r} is invalid: must be an integer "
                                 f">= {lo}{why}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free: list[int] = list(range(1, num_pages))  # a min-heap (ascending list)
        self._owner: list[Sequence | None] = [None] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        """All but the null page."""
        return self.num_pages - 1

    def pages_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is invalid: must be >= 0")
        return -(-num_tokens // self.page_size)

    def num_missing_pages(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.pages_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_pages(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Extend ``seq.block_table`` to ``[0, num_tokens)``; the new pages. Raises RuntimeError
        (nothing allocated): not enough free pages."""
        missing = self.num_missing_pages(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(
                f"BlockManager.allocate: request {seq.request_id!r} needs {missing} more pages for "
                f"{num_tokens} tokens but only {len(self._free)} are free")
        new = [heapq.heappop(self._free) for _ in range(missing)]
        for page in new:
            self._owner[page] = seq
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Free ``seq``'s pages. Raises RuntimeError (nothing freed): no pages (double free), or a
        page it does not own (null, free, another's, twice)."""
        if not seq.block_table:
            raise RuntimeError(f"BlockManager.free: request {seq.request_id!r} holds no pages "
                               "(double free?)")
        for page in seq.block_table:
            if not 0 <= page < self.num_pages or self._owner[page] is not seq:
                owner = self._owner[page] if 0 <= page < self.num_pages else None
                what = ("the null page" if page == NULL_PAGE else
                        "out of range" if not 0 <= page < self.num_pages else
                        "free" if owner is None else f"owned by request {owner.request_id!r}")
                raise RuntimeError(f"BlockManager.free: request {seq.request_id!r} does not own "
                                   f"page {page} ({what})")
        if len(set(seq.block_table)) != len(seq.block_table):
            raise RuntimeError(f"BlockManager.free: request {seq.request_id!r} lists a page twice: "
                               f"{seq.block_table}")
        for page in seq.block_table:
            self._owner[page] = None
            heapq.heappush(self._free, page)
        seq.block_table.clear()

    def owner(self, page: int) -> Sequence | None:
        return self._owner[page]
