"""Issue 18 acceptance 1 and 4 on SmolLM2 real weights (float32): log-probabilities against HF
transformers' ``log_softmax`` of its logits (1e-4 absolute), and presence/frequency penalties,
min_tokens and logit_bias against a plain-numpy reimplementation of vLLM's definitions applied to
HF's logits of the same history (greedy, so every token is checked); neighbours unchanged."""

import numpy as np
import pytest

from jaxinfer import SamplingParams

TOL = 1e-4
STEPS = 16  # sampled positions checked a row: 16 tokens after the chat prompt stay in 4 pages
TEXT = (
    "In the beginning of the twentieth century, the city grew quickly as new railways brought "
    "workers, merchants and families from the countryside, and the old market square became "
    "the busiest place in the whole region."
)


def hf_logprobs(hf_model, ids) -> np.ndarray:
    """f32[len(ids), V]: HF's log_softmax at every position of ``ids`` (float32)."""
    import torch

    with torch.inference_mode():
        logits = hf_model(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def run(llm, requests):
    """The engine's finished `Sequence`s (sample 0) of ``requests`` [(ids, SamplingParams)]."""
    eng = llm.engine
    rids = [eng.add_request(ids, p) for ids, p in requests]
    seqs = [eng.outputs.requests[r].seqs[0] for r in rids]
    while eng.has_unfinished():
        eng.step()
    return seqs


def check_entry(entry, ref: np.ndarray, chosen: int, k: int) -> None:
    """One position's record {id: (logprob, rank)} against HF's log-probabilities ``ref``."""
    assert chosen in entry and len(entry) in (k, k + 1)
    lp, rank = entry[chosen]
    assert abs(lp - ref[chosen]) <= TOL
    # rank as vLLM counts it (ids at least as likely); only near-ties may move it
    assert 1 + (ref > ref[chosen] + TOL).sum() <= rank <= (ref >= ref[chosen] - TOL).sum()
    top = np.sort(ref)[::-1][:k]  # k entries hold the top k (the chosen one among them, or not)
    ranked = sorted((r, t, x) for t, (x, r) in entry.items() if t != chosen or len(entry) == k)
    assert [r for r, _, _ in ranked] == list(range(1, k + 1))
    for rank, t, x in ranked:
        assert abs(x - top[rank - 1]) <= TOL and abs(x - ref[t]) <= TOL


def test_sample_logprobs_match_hf(llm, hf_model, hf_greedy, prompt_ids):
    """logprobs=5 over 16 greedy steps (two rows asking, one not, in one batch): the chosen
    token's logprob, rank 1 and the top 5 match HF; cumulative_logprob sums them; the neighbour
    without logprobs keeps HF's tokens."""
    asks, plain = prompt_ids[3], prompt_ids[0]
    sp = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    seqs = run(
        llm,
        [
            (asks, SamplingParams(**{**vars(sp), "logprobs": 5})),
            (plain, sp),
            (prompt_ids[1], SamplingParams(**{**vars(sp), "logprobs": 0})),
        ],
    )
    assert seqs[1].output_token_ids == hf_greedy(plain, STEPS, ignore_eos=True)
    assert seqs[1].logprobs is None and seqs[1].cumulative_logprob is None
    for ids, s, k in ((asks, seqs[0], 5), (prompt_ids[1], seqs[2], 0)):
        toks = s.output_token_ids
        assert toks == hf_greedy(ids, STEPS, ignore_eos=True) and len(s.logprobs) == STEPS
        ref = hf_logprobs(hf_model, list(ids) + toks[:-1])[len(ids) - 1 :]
        for entry, r, t in zip(s.logprobs, ref, toks):
            check_entry(entry, r, t, k)
            assert entry[t][1] == 1
        assert s.cumulative_logprob == pytest.approx(
            sum(e[t][0] for e, t in zip(s.logprobs, toks)), abs=1e-4
        )


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_hf(llm, hf_model, chunk):
    """prompt_logprobs=5 of a 40-token prompt: entry 0 None, entry j HF's log_softmax at j - 1
    for token j; the same when the prompt is prefilled in chunks of 16 tokens."""
    ids = llm.get_tokenizer().encode(TEXT)[:40]
    assert len(ids) == 40
    sched = llm.engine.scheduler
    budget = sched.max_num_batched_tokens
    try:
        sched.max_num_batched_tokens = chunk or budget
        out = llm.generate(
            {"prompt_token_ids": ids},  # through RequestOutput's Logprobs
            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5),
        )[0]
    finally:
        sched.max_num_batched_tokens = budget
    ref = hf_logprobs(hf_model, ids)
    assert len(out.prompt_logprobs) == 40 and out.prompt_logprobs[0] is None
    for j in range(1, 40):
        entry = out.prompt_logprobs[j]
        assert isinstance(entry[ids[j]].decoded_token, str)
        check_entry({t: (e.logprob, e.rank) for t, e in entry.items()}, ref[j - 1], ids[j], 5)
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def vllm_processed(
    logits: np.ndarray,
    prompt: list[int],
    output: list[int],
    p: SamplingParams,
    eos: tuple[int, ...],
) -> np.ndarray:
    """vLLM's logits before temperature, in numpy: min_tokens (-inf at EOS and stop_token_ids
    while fewer outputs), logit_bias added, repetition penalty over prompt and output ids, then
    ``- frequency x count - presence x [count > 0]`` over the output ids."""
    x = logits.astype(np.float64).copy()
    if len(output) < p.min_tokens:
        x[list({*eos, *p.stop_token_ids})] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen = np.zeros(x.shape, bool)
    seen[prompt + output] = True
    x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.shape[0])[: x.shape[0]]
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_numpy_vllm(llm, hf_model, hf_greedy, prompt_ids):
    """Greedy with presence/frequency/repetition penalties, min_tokens and logit_bias: each token
    is the argmax of `vllm_processed` on HF's logits of the history; the neighbour without them
    keeps HF's plain greedy tokens."""
    import torch

    eos = llm.engine.eos_token_ids
    code, chat, plain = prompt_ids[1], prompt_ids[3], prompt_ids[0]
    n, first = 24, hf_greedy(chat, 1)[0]
    cases = [
        (
            code,
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                presence_penalty=1.5,
                frequency_penalty=0.8,
                ignore_eos=True,
            ),
        ),
        (
            code,
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                frequency_penalty=-0.4,
                presence_penalty=0.6,
                repetition_penalty=1.5,
                ignore_eos=True,
            ),
        ),
        (
            chat,
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                min_tokens=12,
                logit_bias={first: -100.0, 28: 4.0, 1355: 7.5},
            ),
        ),
    ]
    seqs = run(llm, cases + [(plain, SamplingParams(temperature=0.0, max_tokens=n))])
    assert seqs[3].output_token_ids == hf_greedy(plain, n)
    for (ids, p), s in zip(cases, seqs):
        toks = s.output_token_ids
        assert len(toks) >= p.min_tokens
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1 :].numpy()
        changed = 0
        for i, t in enumerate(toks):
            want = vllm_processed(logits[i], ids, toks[:i], p, eos)
            top2 = np.sort(want)[-2:]
            assert t == int(np.argmax(want)) or top2[1] - top2[0] < 1e-3, (p, i)
            changed += int(np.argmax(want)) != int(np.argmax(logits[i]))
        assert changed, p  # the options moved the argmax somewhere: the check has teeth
    assert seqs[2].output_token_ids[0] != first and len(seqs[2].output_token_ids) >= 12
