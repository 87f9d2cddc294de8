"""BlockManager: null page, low-first allocation, ownership, double free, full free list at the end.

The reference is an independent model of the pool: a Python set of free page ids and a dict of
owned pages per sequence, updated by the test itself.
"""

import math
import random

import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams


def seq(rid):
    return Sequence(str(rid), [1, 2, 3], SamplingParams(), 0)


def test_null_page_never_handed_out_and_low_ids_first():
    bm = BlockManager(num_pages=9, page_size=16)
    assert bm.num_usable_pages == 8 and bm.num_free_pages == 8
    a = seq("a")
    assert bm.can_allocate(a, 8 * 16) and not bm.can_allocate(a, 8 * 16 + 1)
    bm.allocate(a, 8 * 16)
    assert a.block_table == list(range(1, 9))  # low ids first, page 0 absent
    assert bm.num_free_pages == 0
    b = seq("b")
    assert bm.can_allocate(b, 0) and not bm.can_allocate(b, 1)
    with pytest.raises(RuntimeError, match="needs 1 more pages"):
        bm.allocate(b, 1)
    assert b.block_table == [] and bm.num_free_pages == 0
    bm.free(a)
    assert a.block_table == [] and bm.num_free_pages == 8


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_allocate_extends_by_ceil(page_size):
    bm = BlockManager(num_pages=64, page_size=page_size)
    s = seq("s")
    for n in [
        0,
        1,
        page_size - 1,
        page_size,
        page_size + 1,
        3 * page_size - 1,
        3 * page_size,
        3 * page_size + 1,
        5 * page_size,
    ]:
        n = max(n, 0)
        want = math.ceil(n / page_size)
        assert bm.pages_needed(n) == want
        bm.allocate(s, n)
        assert len(s.block_table) >= want
        # never shrinks, never over-allocates past the largest request so far
    assert len(s.block_table) == 5
    assert bm.num_free_pages == 63 - 5
    # asking for fewer tokens than held allocates nothing
    assert bm.allocate(s, 1) == [] and len(s.block_table) == 5


def test_reuse_lowest_freed_first():
    bm = BlockManager(num_pages=11, page_size=4)
    a, b, c = seq("a"), seq("b"), seq("c")
    bm.allocate(a, 8)  # pages 1, 2
    bm.allocate(b, 12)  # pages 3, 4, 5
    bm.allocate(c, 4)  # page 6
    assert (a.block_table, b.block_table, c.block_table) == ([1, 2], [3, 4, 5], [6])
    bm.free(b)
    bm.free(a)
    d = seq("d")
    bm.allocate(d, 4 * 4)
    assert d.block_table == [1, 2, 3, 4]
    assert bm.owner(1) is d and bm.owner(6) is c and bm.owner(5) is None and bm.owner(0) is None


def test_double_free_and_foreign_pages_rejected():
    bm = BlockManager(num_pages=6, page_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    bm.allocate(b, 2)
    bm.free(a)
    with pytest.raises(RuntimeError, match="holds no pages"):
        bm.free(a)
    # a table that names someone else's page (e.g. a copied table) is not freed
    a.block_table = list(b.block_table)
    with pytest.raises(RuntimeError, match=r"does not own page 3 \(owned by request 'b'\)"):
        bm.free(a)
    assert bm.owner(3) is b and bm.num_free_pages == 4
    a.block_table = [0]
    with pytest.raises(RuntimeError, match="null page"):
        bm.free(a)
    a.block_table = [2]  # free page
    with pytest.raises(RuntimeError, match=r"page 2 \(free\)"):
        bm.free(a)
    a.block_table = []
    bm.free(b)
    assert bm.num_free_pages == 5


def test_constructor_validation():
    with pytest.raises(ValueError, match=r"BlockManager.num_pages=1 is invalid"):
        BlockManager(1, 16)
    with pytest.raises(ValueError, match=r"BlockManager.page_size=0 is invalid"):
        BlockManager(4, 0)


def test_random_alloc_free_against_set_model():
    rng = random.Random(1234)
    num_pages, page_size = 37, 8
    bm = BlockManager(num_pages, page_size)
    free = set(range(1, num_pages))  # independent model
    owned = {}  # rid -> list of pages, in allocation order
    seqs = {}
    for _ in range(2000):
        if owned and rng.random() < 0.3:
            rid = rng.choice(sorted(owned))
            bm.free(seqs[rid])
            free |= set(owned.pop(rid))
        else:
            rid = rng.randrange(12)
            s = seqs.setdefault(rid, seq(rid))
            n = rng.randrange(0, 80)
            want = max(0, math.ceil(n / page_size) - len(owned.get(rid, [])))
            ok = want <= len(free)
            assert bm.can_allocate(s, n) == ok
            if ok:
                new = sorted(free)[:want]  # lowest free ids
                assert bm.allocate(s, n) == new
                free -= set(new)
                if new or rid in owned:
                    owned.setdefault(rid, []).extend(new)
            else:
                with pytest.raises(RuntimeError):
                    bm.allocate(s, n)
        assert bm.num_free_pages == len(free)
        for rid, pages in owned.items():
            assert seqs[rid].block_table == pages
            assert all(bm.owner(p) is seqs[rid] for p in pages)
    for rid in list(owned):
        if owned[rid]:
            bm.free(seqs[rid])
    assert bm.num_free_pages == num_pages - 1
    # the free list is whole again: allocating everything yields exactly pages 1..P-1 in order
    z = seq("z")
    bm.allocate(z, (num_pages - 1) * page_size)
    assert z.block_table == list(range(1, num_pages))
