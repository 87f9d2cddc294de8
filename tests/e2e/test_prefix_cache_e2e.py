"""Prefix caching on vs off on the tiny random model (float32, CPU; issue 18 acceptance 2).

One engine (the shared ``llm`` fixture) runs each workload twice, greedy: with prefix caching off
(the reference: every request computes its whole prompt) and on, each on a fresh block manager of
the pool size under test. The greedy token ids must be identical; the page accounting (every page
free, cached-unreferenced or held, adding up to the pool) is checked after every step and, at the
end, no page is held.
"""

import contextlib

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.block_manager import BlockManager
from tests.engine.pages import cached_pages, check_pages

from .conftest import PAGE_SIZE as P


@pytest.fixture(scope="module")
def llm(tiny):
    """These mechanics run on the tiny model (tests/e2e/conftest.py)."""
    return tiny


TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, how ideas travelled across Europe, and how people learned "
    "to read. Scholars still argue about its effects on science, religion and politics, and "
    "about the many craftsmen who improved the machines in the centuries that followed."
)


@contextlib.contextmanager
def pool(llm, *, caching: bool, num_pages: int | None = None):
    """The engine with a fresh block manager (and scheduler) for the duration; the KV pool is
    shared, so the saved manager's prefix cache is dropped afterwards (its pages were reused)."""
    eng = llm.engine
    saved = eng.block_manager, eng.scheduler
    bm = BlockManager(
        num_pages or eng.runner.num_pages, eng.page_size, enable_prefix_caching=caching
    )
    eng.block_manager = bm
    eng.scheduler = eng.loop.scheduler = eng._scheduler(bm, eng.eos_token_ids)
    try:
        yield bm
    finally:
        eng.block_manager, eng.scheduler = saved
        eng.loop.scheduler = saved[1]
        assert saved[0].reset_prefix_cache()


def run(llm, prompts, params, *, watch=None):
    """Requests added together, stepped to the end with the accounting checked every step;
    returns ([token ids per request], [num_cached_tokens], [preemptions per request])."""
    eng, bm = llm.engine, llm.engine.block_manager
    rids = [eng.add_request(p, params) for p in prompts]
    seqs, done = {rid: eng.outputs.requests[rid].seqs for rid in rids}, {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        c = check_pages(bm)
        assert c["free"] + c["cached"] + c["used"] == bm.num_usable_pages
        if watch:
            watch(seqs)
    assert check_pages(bm)["used"] == 0
    outs = [done[rid] for rid in rids]
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        [o.num_cached_tokens for o in outs],
        [sum(s.num_preemptions for s in seqs[rid]) for rid in rids],
    )


def on_vs_off(llm, batches, params, num_pages=None):
    """``batches`` (lists of prompts, run one after another on the same pool) off, then on."""
    results = {}
    for caching in (False, True):
        with pool(llm, caching=caching, num_pages=num_pages) as bm:
            results[caching] = [run(llm, b, params) for b in batches]
            if caching:
                cached = cached_pages(bm)
    for off, on in zip(results[False], results[True]):
        assert on[0] == off[0]
    assert all(c == 0 for r in results[False] for c in r[1])
    return results[True], cached


@pytest.fixture(scope="module")
def system(llm):
    ids = llm.get_tokenizer().encode(TEXT * 2)
    assert len(ids) >= 3 * P + 8
    return ids


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def test_shared_three_page_system_prompt_eight_questions(llm, system):
    questions = [
        "What century?",
        "Who made it?",
        "Summarise.",
        "Is it old?",
        "Name a city.",
        "Why books?",
        "One word.",
        "Translate to French.",
    ]
    tok = llm.get_tokenizer()
    prompts = [system[: 3 * P] + tok.encode(q, add_special_tokens=False) for q in questions]
    (run_on,), _ = on_vs_off(llm, [prompts], GREEDY)
    assert run_on[1] == [0] + [3 * P] * 7  # the first computes, the other 7 wait, then hit


@pytest.mark.parametrize("npages", [1, 2, 3])
def test_full_page_prompts_sent_twice(llm, system, npages):
    prompt = system[: npages * P]
    (first, second), _ = on_vs_off(llm, [[prompt], [prompt]], GREEDY)
    assert first[1] == [0] and second[1] == [(npages - 1) * P]  # the last page is computed
    assert first[0] == second[0]


def test_same_prefix_twice_in_one_step(llm, system):
    prompts = [system[: 2 * P + 5], system[: 2 * P + 5], system[: 2 * P] + system[40:45]]
    (run_on,), _ = on_vs_off(llm, [prompts], GREEDY)
    assert run_on[1] == [0, 2 * P, 2 * P]
    assert run_on[0][0] == run_on[0][1]


def test_eviction_under_a_small_pool(llm, system):
    """11 usable pages: a later distinct prompt evicts the first prompt's cached pages."""
    a = system[: 3 * P + 3]
    b, c = system[7 : 7 + 4 * P], system[29 : 29 + 4 * P]
    (ra, rb, rc, ra2), cached = on_vs_off(llm, [[a], [b], [c], [a]], GREEDY, num_pages=12)
    assert ra[0] == ra2[0]
    assert ra2[1][0] < 3 * P  # evicted (at least partly): recomputed, same tokens
    assert cached <= 11


def test_preemption_while_pages_are_shared(llm, system):
    """4 requests sharing a 2-page prefix, 40 output tokens each, in 13 usable pages: decoding
    runs out of pages and preempts requests that hold shared pages."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [system[: 2 * P] + system[50 + 3 * i : 53 + 3 * i] for i in range(4)]
    (run_on,), _ = on_vs_off(llm, [prompts], params, num_pages=14)
    assert sum(run_on[2]) > 0 and run_on[1][1:] == [2 * P] * 3


def test_hit_rate_and_reset(llm, system):
    eng = llm.engine
    with pool(llm, caching=True) as bm:
        eng.runner.stats.prefix_cache_queries = eng.runner.stats.prefix_cache_hits = 0
        bm.stats = eng.runner.stats
        prompt = system[: 2 * P + 1]
        run(llm, [prompt], GREEDY)
        run(llm, [prompt], GREEDY)
        assert eng.stats().prefix_cache_hit_rate == pytest.approx(2 * P / (2 * (2 * P + 1)))
        rid = eng.add_request(prompt, GREEDY)
        eng.step()
        assert llm.reset_prefix_cache() is False and cached_pages(bm) > 0  # pages in use
        eng.abort_request(rid)
        assert llm.reset_prefix_cache() is True and cached_pages(bm) == 0
        assert run(llm, [prompt], GREEDY)[1] == [0]
