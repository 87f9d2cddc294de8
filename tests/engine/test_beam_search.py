"""`LLM.beam_search` mechanics the SmolLM2-vs-HF test (tests/e2e/test_beam_search.py) does not
reach, on the tiny model without a tokenizer: beams that reach ``max_model_len`` end ("length";
vLLM's ``LLM.beam_search`` drops them), the default ``length_penalty=1`` ranking by vLLM's
``get_beam_search_score``, and `BeamSearchParams` validation."""

import pytest

from jaxinfer import BeamSearchParams
from jaxinfer.beam_search import beam_search_score

MAX_LEN = 32


def test_beams_end_at_max_model_len(tiny_llm):
    """A prompt 3 tokens short of ``max_model_len``, 8 steps asked: every beam stops at
    ``max_model_len`` tokens, "length"; text None (no tokenizer); best first by vLLM's score;
    each beam's logprobs hold the 2 x beam_width candidates of its step."""
    llm = tiny_llm(text=False, max_model_len=MAX_LEN, max_compiles=4)
    prompt = [(7 * i) % 256 for i in range(MAX_LEN - 3)]
    (out,) = llm.beam_search(
        [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=8)
    )
    seqs = out.sequences
    assert len(seqs) == 2 and seqs[0].tokens != seqs[1].tokens
    for s in seqs:
        assert len(s.tokens) == MAX_LEN and s.tokens[: len(prompt)] == prompt
        assert (s.finish_reason, s.stop_reason, s.text) == ("length", None, None)
        assert all(len(lp) >= 4 for lp in s.logprobs) and len(s.logprobs) == 3
    scores = [beam_search_score(s, set(), 1.0) for s in seqs]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    "field, value",
    [
        ("beam_width", 0),
        ("beam_width", 11),
        ("beam_width", True),
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("length_penalty", float("nan")),
        ("ignore_eos", 1),
    ],
)
def test_params_are_validated(field, value):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}="):
        BeamSearchParams(**dict(dict(beam_width=2, max_tokens=4), **{field: value}))
