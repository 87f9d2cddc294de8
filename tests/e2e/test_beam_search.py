"""`LLM.beam_search` on SmolLM2 real weights (float32) against HF transformers' beam search.

Ours follows vLLM's ``LLM.beam_search``: each step every live beam is a request of one token with
2 x beam_width logprobs, candidates ending in EOS are kept aside, and the beam_width best by
``cum_logprob / len(tokens) ** length_penalty`` live on; the result is the beam_width best of
finished and live beams. HF's length penalty divides by the *generated* length instead, so both
run with ``length_penalty=0``: both then rank by the cumulative log-probability alone, and with
``early_stopping="never"`` HF, like vLLM, searches up to ``max_new_tokens`` (HF's canonical beam
search). The tests live here for the run's one SmolLM2 `LLM` and HF model (tests/e2e/conftest.py).
"""

import numpy as np
import pytest

from jaxinfer import BeamSearchParams, TokensPrompt
from jaxinfer.beam_search import beam_search_score

WIDTH, STEPS = 3, 6
TOL = STEPS * 1e-4  # test_logprobs_vs_hf.py: float32 log-probabilities agree to 1e-4 a token


def hf_beams(hf_model, ids, eos):
    """HF's ``WIDTH`` best (generated ids ending at the first EOS, cumulative log-probability)."""
    import torch

    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            num_beams=WIDTH,
            num_return_sequences=WIDTH,
            do_sample=False,
            max_new_tokens=STEPS,
            length_penalty=0.0,
            early_stopping="never",
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    beams = []
    for seq in out.sequences[:, len(ids) :].tolist():
        end = next((k + 1 for k, t in enumerate(seq) if t in eos), len(seq))  # then padding
        beams.append(seq[:end])
    return beams, out.sequences_scores.tolist()


def test_beam_search_matches_hf(llm, hf_model, prompt_ids):
    """The 2 plain prompts, beam width 3, 6 tokens: the same sequences in the same order and the
    same cumulative log-probabilities; a beam of the first prompt ends in EOS (the finished-beam
    path is compared too). Each sequence: cum_logprob the sum of its chosen tokens' logprobs,
    ranked best first by vLLM's score, text the detokenized ids without the EOS."""
    prompts, eos = prompt_ids[:2], llm.engine.eos_token_ids
    outs = llm.beam_search(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
        BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, length_penalty=0.0),
    )
    assert len(outs) == len(prompts)
    for ids, out in zip(prompts, outs):
        ref, ref_scores = hf_beams(hf_model, ids, eos)
        assert [s.tokens[len(ids) :] for s in out.sequences] == ref
        np.testing.assert_allclose(
            [s.cum_logprob for s in out.sequences], ref_scores, rtol=0, atol=TOL
        )
        for s in out.sequences:
            gen = s.tokens[len(ids) :]
            assert s.tokens[: len(ids)] == ids and len(s.logprobs) == len(gen)
            assert s.cum_logprob == pytest.approx(
                sum(lp[t].logprob for lp, t in zip(s.logprobs, gen)), abs=1e-9
            )
            ended = gen[-1] in eos
            assert (s.finish_reason, s.stop_reason) == (
                ("stop", gen[-1]) if ended else ("length", None)
            )
            assert s.text == llm.get_tokenizer().decode(
                s.tokens[: len(s.tokens) - ended], skip_special_tokens=False
            )
        scores = [beam_search_score(s, set(eos), 0.0) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    assert outs[0].sequences[0].finish_reason == "stop"  # "The capital of Japan is Tokyo."
