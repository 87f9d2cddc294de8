"""KV page allocator (host side, no JAX): reference-counted pages, lowest free id first; `NULL_PAGE`
never handed out. Prefix caching as vLLM V1: a full page keyed by a chained hash (`_chain`; a hit
also compares the tokens); an unreferenced page keeps its hash (evictable: least recently freed
first, tail pages before head); allocation takes never-cached free pages first."""

import hashlib
import heapq
from array import array
from collections import OrderedDict

from jaxinfer.checks import check_int
from jaxinfer.engine.sequence import Sequence
from jaxinfer.stats import EngineStats

NULL_PAGE = 0  # the reserved page padding points at (the one definition)


class BlockManager:
    """Pages ``1 .. num_pages - 1``, each free, cached and unreferenced (evictable), or held by
    sequences (``owner``: the first holder). ``stats``: counts prefix-cache queried/hit tokens.
    ``enable_prefix_caching`` may be switched while no page is held, after `reset_prefix_cache`.
    Raises ValueError: ``num_pages`` not an integer >= 2, ``page_size`` not >= 1."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = False,
        stats: EngineStats | None = None,
    ) -> None:
        check_int("BlockManager.num_pages", num_pages, 2)  # page 0 is the reserved null page
        check_int("BlockManager.page_size", page_size, 1)
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.stats = stats if stats is not None else EngineStats()
        self._free: list[int] = list(range(1, num_pages))  # uncached; a min-heap (ascending list)
        self._holders: list[list[Sequence]] = [[] for _ in range(num_pages)]
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._key: list[tuple[bytes, tuple] | None] = [None] * num_pages  # (hash, tokens) if cached
        self._cached: dict[bytes, int] = {}  # hash -> page
        self._pending: dict[bytes, Sequence] = {}  # hash -> admitted sequence computing it

    num_free_pages = property(
        lambda self: len(self._free) + len(self._evictable),
        doc="Pages an allocation may take: free plus evictable.",
    )
    num_usable_pages = property(lambda self: self.num_pages - 1, doc="All but the null page.")

    def pages_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is invalid: must be >= 0")
        return -(-num_tokens // self.page_size)

    def num_missing_pages(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.pages_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether `allocate` (sharing ``hits`` first) succeeds."""
        if not hits:
            return self.num_missing_pages(seq, num_tokens) <= self.num_free_pages
        taken = sum(not self._holders[p] for p in hits)  # evictable hits leave the free count
        return self.num_missing_pages(seq, num_tokens) - len(hits) <= self.num_free_pages - taken

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> list[int]:
        """Share the cached pages ``hits`` (from `match_prefix`, ``seq`` holding none), then extend
        ``seq.block_table`` to ``[0, num_tokens)``; the new pages. Raises RuntimeError (nothing
        allocated): not enough free pages, or hits given to a sequence holding pages."""
        missing = self.num_missing_pages(seq, num_tokens)
        if not missing and not hits:  # a decode step inside its last page
            return []
        if hits and seq.block_table:
            raise RuntimeError(
                f"BlockManager.allocate: request {seq.request_id!r} holds pages; "
                "prefix hits are shared only at admission"
            )
        if not self.can_allocate(seq, num_tokens, hits):
            raise RuntimeError(
                f"BlockManager.allocate: request {seq.request_id!r} needs "
                f"{missing - len(hits)} more pages for {num_tokens} tokens but only "
                f"{self.num_free_pages} are free"
            )
        for page in hits:  # evictable hits first, so that no new page evicts one
            if not self._holders[page]:
                del self._evictable[page]
        seq.block_table.extend(hits)
        new = [self._take_page() for _ in range(self.num_missing_pages(seq, num_tokens))]
        for page in (*hits, *new):
            self._holders[page].append(seq)
        seq.block_table.extend(new)
        return new

    def _take_page(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        page, _ = self._evictable.popitem(last=False)  # evict the least recently freed
        del self._cached[self._key[page][0]]
        self._key[page] = None
        return page

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (tail first) and pending hashes. RuntimeError (nothing freed):
        no pages (double free), or a page it does not hold (null, free, another's, twice)."""
        if not seq.block_table:
            raise RuntimeError(
                f"BlockManager.free: request {seq.request_id!r} holds no pages (double free?)"
            )
        for page in seq.block_table:
            if not 0 <= page < self.num_pages or not any(s is seq for s in self._holders[page]):
                owner = self.owner(page) if 0 <= page < self.num_pages else None
                what = (
                    "the null page"
                    if page == NULL_PAGE
                    else "out of range"
                    if not 0 <= page < self.num_pages
                    else "free"
                    if owner is None
                    else f"owned by request {owner.request_id!r}"
                )
                raise RuntimeError(
                    f"BlockManager.free: request {seq.request_id!r} does not own "
                    f"page {page} ({what})"
                )
        if len(set(seq.block_table)) != len(seq.block_table):
            raise RuntimeError(
                f"BlockManager.free: request {seq.request_id!r} lists a page twice: "
                f"{seq.block_table}"
            )
        for page in reversed(seq.block_table):
            holders = self._holders[page]
            del holders[next(i for i, s in enumerate(holders) if s is seq)]
            if not holders:
                if self._key[page] is not None:
                    self._evictable[page] = None
                else:
                    heapq.heappush(self._free, page)
        for h in (h for h in seq.block_hashes if self._pending.get(h) is seq):
            del self._pending[h]
        seq.block_table.clear()

    def owner(self, page: int) -> Sequence | None:
        """The first sequence holding ``page`` (None: free or evictable)."""
        return next(iter(self._holders[page]), None)

    def page_hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """``seq.block_hashes`` extended to its first ``num_pages`` full pages (tokens so far); the
        first page's chain starts from the sequence's LoRA adapter (``lora_int_id``), so pages
        are never shared across adapters."""
        hashes, P = seq.block_hashes, self.page_size
        if len(hashes) < num_pages:
            ids = seq.all_token_ids
            for i in range(len(hashes), num_pages):
                root = b"lora%d" % seq.lora_int_id if seq.lora_int_id else b""  # by adapter
                hashes.append(_chain(hashes[i - 1] if i else root, ids[i * P : (i + 1) * P]))
        return hashes

    def first_page_cached(self, seq: Sequence) -> bool:
        """Whether ``seq``'s first prompt page (not its last token's) is in the cache."""
        return (seq.num_tokens - 1) // self.page_size > 0 and self.page_hashes(seq, 1)[
            0
        ] in self._cached

    def match_prefix(self, seq: Sequence, max_pages: int) -> tuple[list[int], bool]:
        """(cached pages equal to ``seq``'s leading full pages, at most ``max_pages``; whether the
        next page, if below ``max_pages``, is being computed by an admitted sequence)."""
        hashes = self.page_hashes(seq, max_pages)
        ids, P, hits = seq.all_token_ids, self.page_size, []
        for i, h in enumerate(hashes[:max_pages]):
            page = self._cached.get(h)
            if page is None or self._key[page][1] != tuple(ids[i * P : (i + 1) * P]):
                return hits, h in self._pending
            hits.append(page)
        return hits, False

    def mark_pending(self, seq: Sequence, first: int) -> None:
        """``seq`` (just admitted) computes its full pages ``first ..``: pending until published."""
        for h in self.page_hashes(seq, seq.num_tokens // self.page_size)[first:]:
            self._pending.setdefault(h, seq)

    def publish(self, seq: Sequence, lo: int, hi: int) -> None:
        """Publish ``seq``'s full, written pages ``lo .. hi-1``; a cached hash keeps its page."""
        hashes, ids, P = self.page_hashes(seq, hi), seq.all_token_ids, self.page_size
        for i in range(lo, hi):
            page, h = seq.block_table[i], hashes[i]
            if self._pending.get(h) is seq:
                del self._pending[h]
            if self._key[page] is None and h not in self._cached:
                self._cached[h], self._key[page] = page, (h, tuple(ids[i * P : (i + 1) * P]))

    def copy_free(self) -> "BlockManager":
        """A block manager with this one's free and cached-unreferenced pages, none of its held
        ones, and fresh stats (a dry run from now)."""
        bm = BlockManager(
            self.num_pages, self.page_size, enable_prefix_caching=self.enable_prefix_caching
        )
        bm._free, bm._evictable = list(self._free), OrderedDict(self._evictable)
        for page in bm._evictable:
            bm._key[page] = self._key[page]
            bm._cached[self._key[page][0]] = page
        return bm

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes (evictable pages become free); False (no change) if pages held."""
        if any(self._holders):
            return False
        for page in self._evictable:
            self._key[page] = None
            heapq.heappush(self._free, page)
        self._evictable.clear()
        self._cached.clear()
        self._pending.clear()
        return True


def _chain(parent: bytes, tokens) -> bytes:
    """The hash of a full page: blake2b-128 of (parent page's hash, its token ids as int64)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()
