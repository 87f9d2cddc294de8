"""``allowed_token_ids``, ``bad_words`` (both on the structured-output bitmask, ANDed with a
grammar's) and ``logits_processors`` (JAX functions in the jitted step), with vLLM's meanings, on
the tiny text model (character-level tokenizer: one token per character). Each batch holds a
sampled row and stays within one page, so the tests share one set of step shapes."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams, StructuredOutputsParams
from jaxinfer.config import engine_config
from jaxinfer.engine.structured import StructuredOutputManager

PROMPTS = ["The", "Once", "1, 2", "Hi"]
FILLER = dict(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)  # a sampled row


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_compiles=8)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_allowed_token_ids_restrict_every_sampled_token(llm):
    """vLLM: with ``allowed_token_ids`` only those ids are sampled (here at temperature 2, and
    with a grammar: the intersection); the batch's free rows, greedy and seeded, equal the same
    prompts run alone."""
    tok = llm.get_tokenizer()
    allowed = tok.encode("xyz ")
    params = [
        SamplingParams(temperature=2.0, seed=1, max_tokens=12, allowed_token_ids=allowed),
        SamplingParams(
            temperature=2.0,
            seed=2,
            max_tokens=12,
            allowed_token_ids=allowed,
            structured_outputs=StructuredOutputsParams(regex="[a-y]+"),
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    ]
    outs = llm.generate(PROMPTS, params)
    assert len(outs[0].outputs[0].token_ids) == 12 and set(_ids(outs)[0]) <= set(allowed)
    assert len(set(_ids(outs)[0])) > 1  # sampled, not one forced id
    assert set(outs[1].outputs[0].text) <= {"x", "y"} and outs[1].outputs[0].text
    assert _ids(llm.generate(PROMPTS[2:], params[2:])) == _ids(outs)[2:]


def _greedy(llm, prompt, **kw):
    """The token ids of ``prompt`` (text or ids), greedy, beside a sampled row."""
    sp = SamplingParams(**dict(FILLER, temperature=0.0, seed=None, **kw))
    p = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return llm.generate([p, PROMPTS[3]], [sp, SamplingParams(**FILLER)])[0].outputs[0].token_ids


def test_bad_words_never_appear_and_greedy_otherwise(llm):
    """vLLM V1's bad words: the last token of a word's tokens is masked when the output ends with
    the others (vLLM's ``ops/bad_words.py``), so a greedy row takes its second choice there and
    otherwise its argmax; a one-token word never appears."""
    tok = llm.get_tokenizer()
    prompt, ids = tok.encode(PROMPTS[0]), _greedy(llm, PROMPTS[0])
    j = next(
        j
        for j in range(1, len(ids))
        if 3 <= min(ids[j - 1 : j + 1]) and max(ids[j - 1 : j + 1]) < 3 + 94
    )  # two printable non-space characters
    word = ids[j - 1 : j + 1]
    got = _greedy(llm, PROMPTS[0], bad_words=[" " + tok.decode(word)])  # vLLM strips the space
    assert all(got[i : i + 2] != word for i in range(len(got) - 1))
    second = _greedy(
        llm,
        prompt + ids[:j],
        max_tokens=1,
        allowed_token_ids=[t for t in range(len(tok)) if t != ids[j]],
    )
    assert got[:j] == ids[:j] and got[j : j + 1] == second
    full = got[: j + 1] + _greedy(llm, prompt + got[: j + 1], max_tokens=12 - j - 1)
    m = next((i for i in range(j + 1, len(full)) if full[i - 1 : i + 1] == word), len(full))
    assert got[:m] == full[:m]  # greedy, unbanned, from the same history up to the word
    assert ids[0] not in _greedy(llm, PROMPTS[0], bad_words=[tok.decode(ids[:1])])


def test_bad_words_tokenized_as_vllm():
    """vLLM's ``update_from_tokenizer``: a word is tokenized as given (leading spaces stripped)
    and after a space, the latter kept only when its first token differs and it has as many
    tokens; ``allowed_token_ids`` become a bitmask row (bit v % 32 of word v // 32)."""
    words = {"hello": [5, 6], " hello": [7, 6], "a b": [8, 9, 10], " a b": [9, 10, 11, 12]}

    class Tok:
        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return words[text]

    m = StructuredOutputManager(Tok(), 40, [2])
    allowed, bad = m.token_rules(
        SamplingParams(bad_words=["  hello", "a b"], allowed_token_ids=[0, 33, 39])
    )
    assert bad == [[5, 6], [7, 6], [8, 9, 10]]
    assert allowed.dtype == np.int32 and allowed.view(np.uint32).tolist() == [1, 2 | 1 << 7]
    rows = np.full((3, 2), -1, np.int32)
    seq = lambda rules, outs: SimpleNamespace(matcher=None, rules=rules, output_token_ids=outs)
    m.fill(
        rows,
        [
            (0, seq((None, bad), [1, 8, 9])),  # ends with 8, 9: 10 masked; 6 needs 5 or 7
            (2, seq((allowed, [[33]]), [])),
        ],
    )
    assert rows.view(np.uint32).tolist() == [
        [0xFFFFFFFF & ~(1 << 10), 0xFFFFFFFF],
        [0xFFFFFFFF] * 2,
        [1, 1 << 7],
    ]
    assert StructuredOutputManager(Tok(), 40, [2]).token_rules(SamplingParams()) is None
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        StructuredOutputManager(None, 40, [2]).token_rules(SamplingParams(bad_words=["a"]))


def _count_up(ids, logits):
    """Forces 20 first, then the last output id + 1."""
    n = jnp.sum(ids >= 0)
    nxt = jnp.where(n > 0, ids[jnp.maximum(n - 1, 0)] + 1, 20)
    return jnp.where(jnp.arange(logits.shape[0]) == nxt, 0.0, -jnp.inf)


def _ban_low(ids, logits):
    return logits.at[:50].set(-jnp.inf)


def test_logits_processors_apply_to_their_rows_only(llm):
    """vLLM V0's per-request ``logits_processors``: ``fn(output_token_ids, logits) -> logits``
    applied in order to that request's row before sampling (here: each output id the last + 1,
    at temperature 1); the batch's other rows equal the same prompts run alone."""
    params = [
        SamplingParams(
            temperature=1.0, seed=1, max_tokens=6, logits_processors=[_ban_low, _count_up]
        ),
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logits_processors=[_ban_low]
        ),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate(PROMPTS, params)
    assert _ids(outs)[0] == list(range(20, 26))  # _ban_low first: else 20..25 would be -inf
    assert min(_ids(outs)[1]) >= 50
    assert _ids(llm.generate(PROMPTS[2:], params[2:])) == _ids(outs)[2:]


def test_invalid_values_are_rejected(llm):
    """vLLM rejects out-of-vocabulary ``allowed_token_ids`` and bad words without tokens at
    submission; a logits processor that is no JAX (ids, logits) -> logits function, and V1's
    engine-level processor classes (``LLM(logits_processors=[...])``), are refused by name."""
    ids = llm.get_tokenizer().encode("hi")
    v = llm.engine.model_config.vocab_size
    for sp, match in (
        (SamplingParams(allowed_token_ids=[1, v]), f"allowed_token_ids contains {v}, out of range"),
        (SamplingParams(bad_words=["  "]), "bad_words entry '  ' is invalid"),
        (
            SamplingParams(logits_processors=[lambda ids, x: x[:3]]),
            "logits_processors entry .* is invalid: not a JAX",
        ),
        (SamplingParams(logits_processors=[lambda x: x]), "logits_processors entry .* TypeError"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.engine.add_request(ids, sp)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="V1's logits-processor classes are not supported"):
        engine_config(logits_processors=[object])
    with pytest.raises(
        ValueError, match="allowed_token_ids.*non-empty list"
    ):  # vLLM: empty is an error
        SamplingParams(allowed_token_ids=[])
