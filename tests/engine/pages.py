"""``check_pages(bm)``: a `BlockManager`'s page accounting checked from its private state (the
tests' invariant walk; the engine never runs it)."""


def check_pages(bm) -> dict[str, int]:
    """{"free", "cached", "used"} page counts of ``bm`` (cached: evictable, unreferenced), adding
    up to `num_usable_pages`. Raises RuntimeError: a page in two states or none, a bad hash
    table."""
    used = [p for p in range(bm.num_pages) if bm._holders[p]]
    free, cached, key = set(bm._free), set(bm._evictable), bm._key
    errors = [
        what
        for bad, what in (
            (
                sorted([*bm._free, *cached, *used]) != list(range(1, bm.num_pages)),
                "a page is in two states or in none (pages 1..P-1)",
            ),
            (
                any(key[p] is not None for p in free) or any(key[p] is None for p in cached),
                "a free page has a hash or an evictable page has none",
            ),
            (
                {p: k[0] for p, k in enumerate(key) if k} != {p: h for h, p in bm._cached.items()},
                "the hash table and the pages' hashes differ",
            ),
        )
        if bad
    ]
    if errors:
        raise RuntimeError(
            f"check_pages: {'; '.join(errors)} (free={sorted(free)}, "
            f"cached={sorted(cached)}, used={used})"
        )
    return {"free": len(free), "cached": len(cached), "used": len(used)}


def cached_pages(bm) -> int:
    """How many pages of ``bm`` have a published hash (referenced or not)."""
    return len(bm._cached)


def ref_count(bm, page: int) -> int:
    """How many sequences hold ``page`` of ``bm``."""
    return len(bm._holders[page])
