"""Passkey retrieval on SmolLM2-135M-Instruct, float32 KV and fp8 KV: the long-context check of
Mohtashami & Jaggi 2023 ("Landmark Attention", arXiv 2305.16300; LongLoRA's and vLLM's
long-context evaluations use the same prompt): a 5-digit key in repeated filler text, then the
question, greedy decoding through `jaxinfer.LLM` as vLLM's ``LLM.generate`` with
``temperature=0``; the key must come back with both cache dtypes (``kv_cache_dtype="fp8"``: e4m3
pages, scales 1.0, vLLM's default).

2,992 tokens, not the ~6,000 of the issue: on the 2-core CPU the key comes back at 5,920 tokens
too, but fp8 KV took 265 s there (the reference attention over the whole pool), so that length
is checked by hand (BENCHMARKS.md, 2026-12-03), not in the suite; this one takes about 140 s."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams

PASSKEY = "58213"
HEAD = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there. "
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
KEY = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
REPEATS, DEPTH = 122, 0.5  # 2,992 tokens (244: 5,920), the key halfway


def passkey_prompt(repeats: int = REPEATS, depth: float = DEPTH) -> str:
    """HEAD, ``repeats`` fillers with KEY after ``depth`` of them, QUESTION."""
    before = int(repeats * depth)
    return HEAD + FILLER * before + KEY + FILLER * (repeats - before) + QUESTION


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_passkey_retrieved(smollm_path, smollm_engine, kv_cache_dtype):
    """One `LLM` per dtype, one row (max_num_seqs=1, a pool of max_model_len's pages), the
    prompt prefilled in one step (one prefill shape to compile), 8 tokens decoded."""
    n = 3072
    engine = dict(
        smollm_engine,
        max_model_len=n,
        max_num_seqs=1,
        num_pages=n // 16 + 1,
        max_num_batched_tokens=n,
        kernels="batch_buckets=1",
        kv_cache_dtype=kv_cache_dtype,
    )
    llm = LLM(smollm_path, **engine)
    prompt = passkey_prompt()
    assert len(llm.get_tokenizer().encode(prompt)) == 2992
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert PASSKEY in out.outputs[0].text, out.outputs[0].text
