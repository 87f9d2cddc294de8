"""Speculative decoding's "eagle3" method on the tiny random model with a random EAGLE-3 head
(tests/eagle3_head.py): the head's first drafting step against a plain numpy EAGLE-3 head on
the same target hidden states, d2t's mapping in the live drafts, and greedy output equal to
plain decoding (n > 1, prefix caching) with the drafts counted."""

import json

import numpy as np
import pytest
from eagle3_head import AUX, head_tensors, reference_logits, rms, write_head

from jaxinfer import SamplingParams

PROMPTS = [{"prompt_token_ids": ([5, 6, 7, 8, 9, 10] * 8)[: 20 + 3 * i]} for i in range(4)]


@pytest.fixture(scope="module")
def head(tiny_cfg, tmp_path_factory) -> tuple[str, dict]:
    """(directory, HF tensors) of the random head for `TINY`."""
    tensors = head_tensors(tiny_cfg, np.random.default_rng(3))
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", tiny_cfg, tensors), tensors


@pytest.fixture(scope="module")
def engines(tiny_llm, head):
    """(plain, eagle3) tiny engines, prefix caching on, k = 3; proposals recorded: (rows,
    first-step logits, drafts) of each `Eagle3Runner.propose`."""
    spec = dict(method="eagle3", model=head[0], num_speculative_tokens=3)
    plain = tiny_llm(text=False, enable_prefix_caching=True)
    eagle = tiny_llm(text=False, enable_prefix_caching=True, speculative_config=json.dumps(spec))
    drafter, calls = eagle.engine.runner.draft, []
    propose = drafter.propose

    def recorded(rows, k, embed):
        drafts = propose(rows, k, embed)
        calls.append((rows, np.asarray(drafter.first_logits), drafts))
        return drafts

    drafter.propose = recorded
    return plain, eagle, calls


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_equals_plain_decoding(engines):
    """n = 2 on one prompt, prefix caching across prompts: plain decoding's tokens."""
    plain, eagle, calls = engines
    sps = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=2 if i == 1 else 1)
        for i in range(len(PROMPTS))
    ]
    assert _tokens(eagle.generate(PROMPTS, sps)) == _tokens(plain.generate(PROMPTS, sps))
    st = eagle.engine.stats()
    assert st.spec_num_drafts > 0 and calls
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens


def _target_aux(params, cfg, ids) -> tuple[np.ndarray, np.ndarray]:
    """(aux f32[n, 3D] of `AUX`, the final hidden f32[n, D]) of the target over ``ids`` from
    position 0 (`AuxCapture` around `models.forward`, a fresh float32 pool)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.models.eagle3 import AuxCapture
    from jaxinfer.models.kv_cache import init_kv_cache

    n, P = len(ids), 16
    m = -(-n // P)
    kv = init_kv_cache(cfg, m + 1, P, jnp.float32).replace(
        block_tables=jnp.arange(1, m + 1, dtype=jnp.int32)[None],
        seq_lens=jnp.asarray([n], jnp.int32),
    )
    pos = jnp.arange(n, dtype=jnp.int32)[None]

    def run():
        capture = AuxCapture(AUX)
        with capture.capturing():
            hidden, _ = models.forward(params, cfg, jnp.asarray(ids)[None], pos, pos + P, kv)
        return capture.aux()[0], hidden[0]

    return tuple(np.asarray(a) for a in jax.jit(run)())


def test_first_step_logits_equal_reference(engines, head, tiny_cfg, tiny_params):
    """A fresh prompt: the head's first drafting step (after the prefill) equals
    `reference_logits` on the target's aux states (`AUX`: the embedding, the stream after
    layer 0, the stream after layer 1 before the final norm), and its first draft is the
    argmax mapped by d2t; every draft is a target id of the draft vocabulary (t2d)."""
    _, eagle, calls = engines
    calls.clear()
    ids = [int(t) for t in np.random.default_rng(7).integers(3, 250, 21)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = eagle.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
    rows, first, drafts = calls[0]
    assert rows[0][:2] == (out[0], len(ids))
    aux, hidden = _target_aux(tiny_params, tiny_cfg, ids)
    embed = np.asarray(tiny_params["embed"])
    np.testing.assert_allclose(aux[:, :64], embed[ids], rtol=1e-6)
    final = rms(aux[:, 128:], np.asarray(tiny_params["final_norm"]), tiny_cfg.rms_norm_eps)
    np.testing.assert_allclose(final, hidden, rtol=1e-4, atol=1e-5)
    hf = head[1]
    want = reference_logits(hf, tiny_cfg, embed, ids[1:] + [out[0]], aux)
    np.testing.assert_allclose(first[0], want, rtol=1e-4, atol=1e-4)
    d = int(np.argmax(want))
    assert drafts[0, 0] == d + hf["d2t"][d]
    allowed = set(np.flatnonzero(hf["t2d"]).tolist())
    assert all(set(np.asarray(dr).ravel().tolist()) <= allowed for _, _, dr in calls)
