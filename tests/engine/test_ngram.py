"""NgramProposer against vLLM's n-gram proposer semantics (vllm/v1/spec_decode/ngram_proposer.py).

Hand cases derive their drafts from vLLM's rule: the longest suffix n-gram (n <= max) that also
occurs earlier (an occurrence ending before the last token, overlap allowed), its earliest
occurrence, then up to k tokens that follow it, cut at the end of the sequence. The random cases
compare with `brute_force`, a plain double loop over n (longest first) and start (earliest first).
"""

import random

import numpy as np
import pytest

from jaxinfer.spec.ngram import NgramProposer


def brute_force(tokens, lo, hi, k):
    """The rule written as directly as possible: slices compared as lists, no early pruning."""
    tokens = list(tokens)
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        suffix = tokens[size - n :] if n <= size else None
        for start in range(0, size - n):  # start + n <= size - 1: not the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(tokens, lo, hi, k):
    return NgramProposer(k, lo, hi).propose(tokens)


def test_vllm_docstring_example():
    # vLLM's own example: [4,2,3] (n=3) occurs nowhere before; [2,3] (n=2) occurs at 1, and only
    # three tokens follow it, so k=4 gives [4,2,3].
    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_earliest_occurrence_wins():
    # The suffix [1,2] occurs at 1 (followed by 7) and at 4 (followed by 8): vLLM keeps the
    # earliest (its KMP scan runs over the reversed tokens and updates on ties, `>=`).
    assert propose([5, 1, 2, 7, 1, 2, 8, 1, 2], 1, 2, 1) == [7]
    assert propose([5, 1, 2, 7, 1, 2, 8, 1, 2], 1, 2, 3) == [7, 1, 2]


def test_longest_ngram_beats_an_earlier_shorter_one():
    # [4] occurs first at 0, but [3,4] occurs at 3 and [2,3,4] nowhere before: n=2 wins and the
    # draft starts after it, at 5. With max=1 only [4] counts and its earliest occurrence is 0.
    tokens = [4, 1, 8, 3, 4, 2, 3, 4]
    assert propose(tokens, 1, 3, 3) == [2, 3, 4]
    assert propose(tokens, 1, 1, 3) == [1, 8, 3]


def test_repeated_tokens_overlap_the_suffix():
    # [1]*5: the last 3 ones also occur at 0 (ending at 2, before the last token): n=3, earliest
    # start 0, draft from 3 runs into the suffix: [1,1]. max=4: n=4 at 0 ends at 3, draft [1].
    # max=5: n=5 would be the suffix itself, so n=4 again.
    assert propose([1] * 5, 1, 3, 5) == [1, 1]
    assert propose([1] * 5, 1, 4, 5) == [1]
    assert propose([1] * 5, 1, 5, 5) == [1]
    assert propose([1] * 5, 5, 5, 5) == []


def test_min_length_filters_short_matches():
    # Only [3] (n=1) occurs earlier, at 2: below min=2 there is no draft.
    assert propose([1, 2, 3, 9, 3], 2, 3, 4) == []
    assert propose([1, 2, 3, 9, 3], 1, 3, 4) == [9, 3]


def test_match_at_the_very_start():
    assert propose([9, 8, 7, 1, 2, 9, 8], 2, 2, 3) == [7, 1, 2]


def test_k_larger_than_what_follows():
    assert propose([1, 2, 3, 1, 2], 2, 2, 10) == [3, 1, 2]


def test_no_match_and_too_short():
    assert propose([1, 2, 3, 4], 1, 3, 3) == []
    assert propose([1, 2], 3, 4, 3) == []  # shorter than min
    assert propose([7], 1, 1, 3) == []
    assert propose([], 1, 1, 3) == []


def test_k_argument_and_array_input():
    p = NgramProposer(2, 1, 3)
    tokens = [5, 1, 2, 7, 6, 1, 2]
    assert p.propose(tokens) == [7, 6]
    assert p.propose(tokens, k=4) == [7, 6, 1, 2]
    assert p.propose(tokens, k=0) == []
    assert p.propose(np.asarray(tokens, np.int32), k=np.int64(3)) == [7, 6, 1]
    assert all(type(t) is int for t in p.propose(np.asarray(tokens, np.int32)))


@pytest.mark.parametrize(
    "lo,hi,k", [(1, 1, 1), (1, 2, 3), (1, 3, 5), (2, 2, 2), (2, 4, 4), (3, 5, 2), (1, 8, 7)]
)
def test_random_sequences_match_brute_force(lo, hi, k):
    rng = random.Random(lo * 100 + hi * 10 + k)
    p = NgramProposer(k, lo, hi)
    for _ in range(300):
        alphabet = rng.choice([2, 3, 4])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 30))]
        want = brute_force(tokens, lo, hi, k)
        assert p.propose(tokens) == want, tokens
        assert p.propose(np.asarray(tokens, np.int32)) == want, tokens


def test_long_run_of_one_token():
    # 32,000 equal tokens: n=max at start 0, the draft is the k tokens after it.
    assert propose(np.full(32_000, 3, np.int32), 2, 5, 4) == [3, 3, 3, 3]


@pytest.mark.parametrize(
    "args,field",
    [
        ((0, 1, 1), "num_speculative_tokens=0"),
        ((1, 0, 1), "prompt_lookup_min=0"),
        ((1, 1, 0), "prompt_lookup_max=0"),
        ((1, 3, 2), "prompt_lookup_max=2"),
        ((True, 1, 1), "num_speculative_tokens=True"),
        ((2.0, 1, 1), "num_speculative_tokens=2.0"),
        ((1, "1", 2), "prompt_lookup_min='1'"),
    ],
)
def test_constructor_validation(args, field):
    with pytest.raises(ValueError, match=f"^{field} is invalid: must be an integer"):
        NgramProposer(*args)


def test_propose_validation():
    p = NgramProposer(2, 1, 2)
    with pytest.raises(ValueError, match="k=-1 is invalid"):
        p.propose([1, 2, 1], k=-1)
    with pytest.raises(ValueError, match="k=1.5 is invalid"):
        p.propose([1, 2, 1], k=1.5)
    with pytest.raises(ValueError, match="token_ids is invalid"):
        p.propose([[1, 2], [1, 2]])
    with pytest.raises(ValueError, match="token_ids is invalid"):
        p.propose([1.0, 2.0, 1.0])
