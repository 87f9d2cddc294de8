"""N-gram (prompt lookup) draft proposer, host side: NumPy only, no JAX.

Reference followed: vLLM's ``vllm/v1/spec_decode/ngram_proposer.py``
(``_find_longest_matched_ngram_and_propose_tokens``, a KMP scan over the reversed tokens). Its
semantics, restated for the original (unreversed) order, with ``N = len(token_ids)``:

* the n-gram length is ``L``, the largest ``n <= prompt_lookup_max`` such that the last ``n``
  tokens also occur as ``token_ids[s:s + n]`` with ``s + n <= N - 1``: any earlier occurrence,
  overlapping the suffix allowed, the suffix itself excluded; no draft if ``L < prompt_lookup_min``;
* of the occurrences of that length the earliest one (smallest ``s``) is used;
* the draft is ``token_ids[s + L : s + L + k]``: it may run into the suffix itself and is cut at
  the end of the sequence, so it holds between 1 and ``k`` tokens.

vLLM also caps ``k`` at ``max_model_len - N``; a caller that wants that passes
``k=min(k, max_model_len - len(token_ids))`` (``k=0`` gives no draft).
"""

import numpy as np

from jaxinfer.checks import check_int, is_int


def _earliest_longest_end(tokens: np.ndarray, max_n: int) -> tuple[int, int]:
    """``(length, end)``: the longest ``length <= max_n`` such that ``tokens[-length:]`` also ends
    at an index ``end <= len(tokens) - 2``, and the smallest such ``end``; ``(0, -1)`` if even
    the last token occurs nowhere before.

    ``live[e]`` says whether the last ``length`` tokens also end at ``e``; each step extends the
    match one token further back with one vectorized comparison of shifted views, so the cost is
    O(N * length) element operations with no Python loop over positions."""
    last = len(tokens) - 1
    live = tokens[:last] == tokens[last]
    length, best = 0, -1
    while length < max_n:
        first = int(live.argmax())
        if not live[first]:
            break
        length, best = length + 1, first
        if length == max_n:
            break
        live[:length] = False  # an end before `length` has no room for one more token
        live[length:] &= tokens[: last - length] == tokens[last - length]
    return length, best


class NgramProposer:
    """Proposes draft tokens by prompt lookup, as vLLM's n-gram proposer does (see the module
    docstring for the exact rule and the reference file).

    ``num_speculative_tokens`` (>= 1) is the default number of drafts; ``prompt_lookup_min`` and
    ``prompt_lookup_max`` (1 <= min <= max) bound the length of the suffix n-gram matched."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        check_int("num_speculative_tokens", num_speculative_tokens, 1)
        check_int("prompt_lookup_min", prompt_lookup_min, 1)
        check_int("prompt_lookup_max", prompt_lookup_max, 1)
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max={prompt_lookup_max!r} is invalid: must be an integer >= "
                f"prompt_lookup_min={prompt_lookup_min!r}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids, k: int | None = None) -> list[int]:
        """Drafts for a sequence whose tokens so far (prompt + outputs) are ``token_ids`` (a list
        of ints or a 1-D integer array): find the longest ``n`` in ``[prompt_lookup_min,
        prompt_lookup_max]`` such that the last ``n`` tokens occur earlier in ``token_ids``, and
        propose up to ``k`` (default ``num_speculative_tokens``; an int >= 0) tokens that followed
        the earliest such occurrence; ``[]`` if there is no match (or ``k == 0``).

        The earlier occurrence may overlap the suffix and the draft may run into it; fewer than
        ``k`` tokens come back when the occurrence is closer than ``k`` to the end."""
        if k is None:
            k = self.num_speculative_tokens
        elif not is_int(k, 0, numpy=True):
            raise ValueError(f"k={k!r} is invalid: must be None or an integer >= 0")
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise ValueError(
                f"token_ids is invalid: must be a 1-D sequence of integers, got an array of "
                f"shape {tokens.shape} and dtype {tokens.dtype}"
            )
        if k == 0 or len(tokens) < max(self.prompt_lookup_min, 2):
            return []
        length, end = _earliest_longest_end(tokens, self.prompt_lookup_max)
        if length < self.prompt_lookup_min:
            return []
        return tokens[end + 1 : end + 1 + int(k)].tolist()
