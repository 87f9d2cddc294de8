"""``n`` > 1 parallel sampling on the tiny random model (float32, CPU; issue 18 acceptance 3).

Sample i of a request seeded s draws from its own stream seeded ``sample_seed(s, i)``, so the
reference for a sample is the same prompt sent as an n=1 request with that seed: the n samples
must equal those n independent requests, on repeat runs and in any batch composition, with the
prefix cache on or off, and differ from one another; the prompt's full pages are held once.
"""

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.llm_engine import sample_seed
from tests.engine.pages import check_pages

from .conftest import PAGE_SIZE as P
from .test_prefix_cache_e2e import TEXT, pool

SEED = 1234


@pytest.fixture(scope="module")
def llm(tiny):
    """These mechanics run on the tiny model (tests/e2e/conftest.py)."""
    return tiny


def params(**kw):
    return SamplingParams(
        **dict(dict(temperature=1.0, max_tokens=10, ignore_eos=True, seed=SEED, n=4), **kw)
    )


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.get_tokenizer().encode(TEXT)[: 2 * P + 7]


@pytest.fixture(scope="module")
def alone(llm, prompt):
    """The reference: each sample as an independent n=1 request with its derived seed."""
    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * 4,
        [params(n=1, seed=sample_seed(SEED, i)) for i in range(4)],
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def samples(out):
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    return [list(c.token_ids) for c in out.outputs]


def test_n4_equals_independent_requests_and_samples_differ(llm, prompt, alone):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params())
    assert samples(out) == alone
    assert len({tuple(s) for s in alone}) == 4
    assert out.prompt_token_ids == prompt
    assert out.num_cached_tokens == 2 * P  # sample 0: the pages `alone` left cached
    (again,) = llm.generate([{"prompt_token_ids": prompt}], params())
    assert samples(again) == alone


def test_n4_in_other_batch_compositions(llm, prompt, alone):
    other = llm.get_tokenizer().encode("def fibonacci(n):")
    outs = llm.generate(
        [
            {"prompt_token_ids": other},
            {"prompt_token_ids": prompt},
            {"prompt_token_ids": prompt[:20]},
        ],
        [params(n=2, seed=7), params(), params(n=3, seed=SEED)],
    )
    assert samples(outs[1]) == alone
    assert len(outs[0].outputs) == 2 and len(outs[2].outputs) == 3
    with pool(llm, caching=False):
        (off,) = llm.generate([{"prompt_token_ids": prompt}], params())
    assert samples(off) == alone


def test_n1_is_sample_zero(llm, prompt, alone):
    (one,) = llm.generate([{"prompt_token_ids": prompt}], params(n=1))
    assert [list(c.token_ids) for c in one.outputs] == [alone[0]]


def test_prompt_pages_held_once(llm, prompt):
    eng = llm.engine
    with pool(llm, caching=True) as bm:
        rid = eng.add_request(prompt, params())
        seqs, tables = eng.outputs.requests[rid].seqs, None
        while eng.has_unfinished():
            eng.step()
            if tables is None and all(s.block_table for s in seqs):
                tables = [list(s.block_table) for s in seqs]
                used = check_pages(bm)["used"]
    full = len(prompt) // P  # 2 full prompt pages, shared
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({p for t in tables for p in t}) == used == full + 4 * (len(tables[0]) - full)
    assert [s.num_cached_tokens for s in seqs] == [0] + [full * P] * 3
