"""LoRA's mechanics on the tiny random model (issue 48 items 1-3): adapters written in PEFT's
layout (tests/lora_adapters.py), expected outputs from an independent reference: the plain
engine serving the adapter merged into the base weights (W + scaling A^T B^T), or the base
weights for rows without one. Four adapters and plain rows in one batch; loading and swapping
compile nothing; LRU eviction and waiting for a slot; `LLM.update_lora`; the prefix cache keyed
by adapter; beam search with adapters; the errors."""

import json
import os
import re

import numpy as np
import pytest
from lora_adapters import merged, write_adapter

from jaxinfer import LoRARequest, SamplingParams
from jaxinfer.lora.peft import read_config

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5 + i, 17, 3 * i + 1, 40, 9, 11 + i] for i in range(6)]
SPECS = [  # rank, seed, modules, use_rslora
    (8, 1, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (4, 2, ("q_proj", "v_proj"), False),
    (8, 3, ("o_proj", "down_proj", "up_proj"), True),
    (2, 4, ("k_proj", "gate_proj"), False),
    (6, 5, ("q_proj", "down_proj"), False),
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_cfg):
    """[(LoRARequest, tensors, scaling)] of the five `SPECS` adapters, ids 1..5."""
    root, out = tmp_path_factory.mktemp("adapters"), []
    for i, (rank, seed, modules, rs) in enumerate(SPECS):
        path = str(root / f"a{i + 1}")
        tensors, scaling = write_adapter(path, tiny_cfg, rank, seed, modules, rslora=rs)
        out.append((LoRARequest(f"a{i + 1}", i + 1, path), tensors, scaling))
    return out


@pytest.fixture(scope="module")
def lora(tiny_llm):
    return tiny_llm(text=False, enable_lora=True, max_loras=4, max_lora_rank=8, max_compiles=8)


@pytest.fixture(scope="module")
def plain(tiny_llm):
    return tiny_llm(text=False, seed=48, max_compiles=8)  # its own: update_params swaps weights


def tokens(outs) -> list:
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(plain, params, cfg, prompts, adapter=None) -> list:
    """``prompts`` alone on the plain engine serving ``adapter`` (tensors, scaling) merged."""
    plain.update_params(params if adapter is None else merged(params, cfg, *adapter))
    try:
        return tokens(plain.generate([{"prompt_token_ids": p} for p in prompts], SP))
    finally:
        plain.update_params(params)


def run(llm, prompts, reqs) -> list:
    return tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], SP, lora_request=reqs))


def test_mixed_batch_equals_each_alone(lora, plain, adapters, tiny_cfg, tiny_params):
    """Rows of four adapters and two without, one batch: each row's tokens as its adapter's
    merged weights give alone; the same batch with adapters moved between rows and a fifth
    adapter loaded (evicting one) compiles nothing."""
    reqs = [adapters[0][0], adapters[1][0], None, adapters[2][0], adapters[3][0], None]
    got = run(lora, PROMPTS, reqs)
    for i, r in enumerate(reqs):
        a = None if r is None else adapters[r.lora_int_id - 1][1:]
        assert got[i] == reference(plain, tiny_params, tiny_cfg, [PROMPTS[i]], a)[0], i
    assert got[2] != run(lora, [PROMPTS[2]], adapters[0][0])[0]  # the adapter changes it
    before = lora.engine.stats()
    swapped = [None, adapters[3][0], adapters[4][0], adapters[0][0], None, adapters[1][0]]
    again = run(lora, PROMPTS, swapped)
    after = lora.engine.stats()
    assert after.forward_shapes == before.forward_shapes
    assert after.sampler_shapes == before.sampler_shapes
    for i, r in enumerate(swapped):
        a = None if r is None else adapters[r.lora_int_id - 1][1:]
        assert again[i] == reference(plain, tiny_params, tiny_cfg, [PROMPTS[i]], a)[0], i


def test_lru_eviction_and_waiting(lora, plain, adapters, tiny_cfg, tiny_params):
    """Four slots: a fifth adapter evicts the least recently used idle one; five adapters in
    one call: the fifth waits for a slot, and every row still equals its reference."""
    reqs = [a[0] for a in adapters[:4]]
    run(lora, PROMPTS[:4], reqs)  # a4 used last, a1 first
    run(lora, PROMPTS[:1], adapters[0][0])  # a1 now most recent: a2 is the LRU one
    run(lora, PROMPTS[:1], adapters[4][0])
    assert sorted(lora.engine.lora.slots) == [1, 3, 4, 5]
    reqs = [a[0] for a in adapters]
    got = run(lora, PROMPTS[:5], reqs)
    for i, a in enumerate(adapters):
        assert got[i] == reference(plain, tiny_params, tiny_cfg, [PROMPTS[i]], a[1:])[0]
    assert not lora.engine.lora.pending


def test_update_lora(lora, plain, adapters, tiny_cfg, tiny_params):
    """`LLM.update_lora` with new tensors (by name, then by id): outputs as the new weights
    merged give; unknown adapters, wrong shapes and missing or unexpected modules are
    ValueErrors naming them."""
    from lora_adapters import random_tensors

    req, old, scaling = adapters[1]
    new = random_tensors(tiny_cfg, 4, 99, SPECS[1][2])
    run(lora, PROMPTS[:1], req)  # known to the engine (each test may run on its own worker)
    try:
        lora.update_lora("a2", new)
        want = reference(plain, tiny_params, tiny_cfg, PROMPTS[:2], (new, scaling))
        assert run(lora, PROMPTS[:2], req) == want
    finally:
        lora.update_lora(2, old)
    assert run(lora, PROMPTS[:1], req) == reference(
        plain, tiny_params, tiny_cfg, PROMPTS[:1], (old, scaling)
    )
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'"):
        lora.update_lora("nope", new)
    bad = {k: v[:, :1] if "lora_A" in k else v for k, v in new.items()}
    with pytest.raises(ValueError, match="has shape"):
        lora.update_lora("a2", bad)
    nan = {k: np.full_like(v, np.nan) for k, v in new.items()}  # a diverged trainer's
    with pytest.raises(ValueError, match="non-finite values"):
        lora.update_lora("a2", nan)
    with pytest.raises(ValueError, match=r"missing modules \['q_proj', 'v_proj'\] \(the"):
        lora.update_lora("a2", {})
    extra = random_tensors(tiny_cfg, 4, 98, ("q_proj", "k_proj"))
    with pytest.raises(
        ValueError, match=r"missing modules \['v_proj'\]; unexpected modules \['k_proj'\]"
    ):
        lora.update_lora("a2", extra)
    assert run(lora, PROMPTS[:1], None) == reference(plain, tiny_params, tiny_cfg, PROMPTS[:1])


def test_prefix_cache_keyed_by_adapter(lora, adapters):
    """A 40-token prompt: run with a1, then with a3 (no page of a1's reused), then with a1
    again (its full pages reused)."""
    prompt = [(7 * i + 3) % 200 + 3 for i in range(40)]
    first = lora.generate([{"prompt_token_ids": prompt}], SP, lora_request=adapters[0][0])[0]
    other = lora.generate([{"prompt_token_ids": prompt}], SP, lora_request=adapters[2][0])[0]
    same = lora.generate([{"prompt_token_ids": prompt}], SP, lora_request=adapters[0][0])[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 32
    assert tokens([same]) == tokens([first]) != tokens([other])


def test_errors(lora, plain, adapters, tiny_cfg, tmp_path):
    """Clear ValueErrors: a LoRA request or update_lora without enable_lora, a rank above
    max_lora_rank, an unknown target module, a directory without a config, a list of the wrong
    length, an id reused under another name."""
    p = [{"prompt_token_ids": PROMPTS[0]}]
    lora.generate(p, SP, lora_request=adapters[0][0])  # a1 known (tests may run apart)
    with pytest.raises(
        ValueError, match="lora_request='a1' needs an engine built with enable_lora=True"
    ):
        plain.generate(p, SP, lora_request=adapters[0][0])
    with pytest.raises(
        ValueError, match=r"update_lora\('a1'\) needs an engine built with enable_lora=True"
    ):
        plain.update_lora("a1", {})
    write_adapter(tmp_path / "big", tiny_cfg, 16, 0, ("q_proj",))
    with pytest.raises(ValueError, match=r"r=16 is invalid.*max_lora_rank=8"):
        lora.generate(p, SP, lora_request=LoRARequest("big", 11, str(tmp_path / "big")))
    write_adapter(tmp_path / "emb", tiny_cfg, 2, 0, ("q_proj",))
    cfg_file = tmp_path / "emb" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps(dict(cfg, target_modules=["q_proj", "embed_tokens"])))
    with pytest.raises(ValueError, match=r"target_modules \['embed_tokens'\] are not supported"):
        lora.generate(p, SP, lora_request=LoRARequest("emb", 12, str(tmp_path / "emb")))
    # peft's "all-linear" saves full module paths: read as their last names
    full = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    cfg_file.write_text(json.dumps(dict(cfg, target_modules=full)))
    assert read_config(str(tmp_path / "emb"), 8) == (2, cfg["lora_alpha"] / 2)
    cfg_file.write_text(json.dumps(dict(cfg, target_modules=[*full, "model.embed_tokens"])))
    with pytest.raises(ValueError, match=r"target_modules \['embed_tokens'\] are not supported"):
        read_config(str(tmp_path / "emb"), 8)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora.generate(p, SP, lora_request=LoRARequest("e", 13, str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="2 requests for 1 prompts"):
        lora.generate(p, SP, lora_request=[adapters[0][0]] * 2)
    with pytest.raises(ValueError, match="already adapter 'a1'"):
        lora.generate(p, SP, lora_request=LoRARequest("other", 1, adapters[1][0].lora_path))
    with pytest.raises(ValueError, match="lora_int_id=0 must be >= 1"):
        LoRARequest("x", 0, "/x")
    assert not lora.engine.has_unfinished()


def test_outputs_name_their_adapter_and_a_refused_one_fails_alone(lora, adapters, tmp_path):
    """vLLM's `RequestOutput.lora_request`: the `LoRARequest` each request ran with (None: the
    base model), streamed or not; with on_error="return" a request whose adapter is refused
    comes back with its error and the others run."""
    p = [{"prompt_token_ids": q} for q in PROMPTS[:3]]
    reqs = [adapters[0][0], None, adapters[1][0]]
    assert [o.lora_request for o in lora.generate(p, SP, lora_request=reqs)] == reqs
    streamed = lora.generate(p, SP, lora_request=reqs, stream=lambda *_: None)
    assert [o.lora_request for o in streamed] == reqs
    missing = LoRARequest("missing", 14, str(tmp_path / "none"))
    outs = lora.generate(p[:2], SP, lora_request=[missing, reqs[0]], on_error="return")
    assert "no such directory" in outs[0].error and outs[0].lora_request == missing
    assert outs[1].error is None and tokens(outs[1:]) == run(lora, PROMPTS[1:2], reqs[0])


def test_malformed_config_errors_name_the_path(tmp_path, tiny_cfg):
    """adapter_config.json that is not JSON, not an object, or has target_modules of another
    type: a ValueError (`AdapterError`) naming the directory and the fault."""
    from jaxinfer.lora.peft import AdapterError, check_adapter

    path = tmp_path / "bad"
    write_adapter(path, tiny_cfg, 2, 0, ("q_proj",))
    cfg_file = path / "adapter_config.json"
    for text, fault in (
        ('{"r": 2,', r"adapter_config.json is not valid JSON \(Expecting"),
        ("[1, 2]", "adapter_config.json holds a list; a JSON object is needed"),
        (json.dumps(dict(r=2, target_modules=7)), "target_modules=7 is invalid"),
    ):
        cfg_file.write_text(text)
        with pytest.raises(AdapterError, match=f"LoRA adapter '{re.escape(str(path))}': {fault}"):
            read_config(str(path), 8)
    cfg_file.write_text(json.dumps(dict(r=2, target_modules=["q_proj"])))
    os.remove(path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        check_adapter(str(path), 8)


def test_errors_name_the_adapter_and_its_path(lora, tiny_cfg, tmp_path):
    """Where the adapter's name is known (`LoRARequest.lora_name`), its errors name it before
    its path, one line: ``LoRA adapter 'big' ('/x/big'): r=16 is invalid: ...``;
    `AdapterError.named` leaves an error that names no adapter, or names it already, as it is."""
    from jaxinfer.lora.peft import AdapterError

    big, empty = tmp_path / "big", tmp_path / "empty"
    write_adapter(big, tiny_cfg, 16, 0, ("q_proj",))
    os.makedirs(empty)
    for req, want in (
        (
            LoRARequest("big", 21, str(big)),
            f"LoRA adapter 'big' ('{big}'): r=16 is invalid: must be an integer in "
            "[1, max_lora_rank=8]",
        ),
        (
            LoRARequest("sql", 22, str(empty)),
            f"LoRA adapter 'sql' ('{empty}'): no adapter_config.json (a PEFT LoRA directory is "
            "needed)",
        ),
    ):
        with pytest.raises(AdapterError) as e:
            lora.generate([{"prompt_token_ids": PROMPTS[0]}], SP, lora_request=req)
        assert str(e.value) == want
    plain = AdapterError("lora_request='x' needs an engine built with enable_lora=True")
    named = AdapterError("LoRA adapter 'x': tensor 'w' has non-finite values", "x", "tensor ...")
    assert plain.named("x") is plain and named.named("x") is named
    assert not lora.engine.has_unfinished()


def test_target_modules_checked_against_the_weights(tmp_path, tiny_cfg):
    """adapter_config.json's target_modules must be a non-empty list of supported names (not
    PEFT's regex string, not missing), layers_to_transform / layers_pattern must be None, and
    the weights may hold only modules target_modules names: `AdapterError`s naming the field,
    the value and what is allowed (the weights' extra modules by name)."""
    from jaxinfer.lora.peft import AdapterError, load_adapter

    path = tmp_path / "t"
    write_adapter(path, tiny_cfg, 2, 0, ("q_proj", "v_proj"))
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    names = r"a non-empty list of module names of \['q_proj'"
    for change, fault in (
        (
            dict(target_modules=".*(q|v)_proj"),
            rf"target_modules='.*\(q\|v\)_proj' is a regex string: not supported; allowed: {names}",
        ),
        (dict(target_modules=[]), rf"target_modules=\[\] names no module; allowed: {names}"),
        (dict(target_modules=None), rf"target_modules=None is invalid: must be {names}"),
        (
            dict(layers_to_transform=[0]),
            r"layers_to_transform=\[0\] is not supported; allowed: None",
        ),
        (dict(layers_pattern="layers"), r"layers_pattern='layers' is not supported; allowed: None"),
        (
            dict(target_modules=["q_proj"]),
            r"adapter_model.safetensors holds modules \['v_proj'\] that adapter_config.json's "
            r"target_modules \['q_proj'\] does not name",
        ),
    ):
        cfg_file.write_text(json.dumps(dict(cfg, **change)))
        with pytest.raises(AdapterError, match=f"LoRA adapter '{re.escape(str(path))}': {fault}"):
            load_adapter(str(path), tiny_cfg, 8)
    cfg_file.write_text(json.dumps(dict(cfg, layers_to_transform=None, layers_pattern=None)))
    assert set(load_adapter(str(path), tiny_cfg, 8).weights) == {"q_proj", "v_proj"}
    cfg_file.write_text(json.dumps(dict(cfg, target_modules=["q_proj", "v_proj", "o_proj"])))
    assert set(load_adapter(str(path), tiny_cfg, 8).weights) == {"q_proj", "v_proj"}


def test_beam_search_with_adapters(lora, plain, adapters, tiny_cfg, tiny_params):
    """`LLM.beam_search(..., lora_request=...)` (vLLM's argument): width 1 equals greedy with
    the adapter; width 2 with [a1, None] equals the plain engine's beam search over a1's merged
    weights for the first prompt and over the base weights for the second."""
    from jaxinfer.sampling_params import BeamSearchParams

    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    one = BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    got = lora.beam_search(prompts, one, lora_request=adapters[0][0])
    want = [
        p["prompt_token_ids"] + t for p, t in zip(prompts, run(lora, PROMPTS[:2], adapters[0][0]))
    ]
    assert [o.sequences[0].tokens for o in got] == want
    two = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    got = lora.beam_search(prompts, two, lora_request=[adapters[0][0], None])
    plain.update_params(merged(tiny_params, tiny_cfg, *adapters[0][1:]))
    try:
        with_a1 = plain.beam_search(prompts[:1], two)[0]
    finally:
        plain.update_params(tiny_params)
    base = plain.beam_search(prompts[1:], two)[0]
    for out, ref in zip(got, (with_a1, base)):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
        np.testing.assert_allclose(
            [s.cum_logprob for s in out.sequences],
            [s.cum_logprob for s in ref.sequences],
            atol=1e-3,
        )
    assert [s.tokens for s in got[0].sequences] != [
        s.tokens for s in lora.beam_search(prompts[:1], two)[0].sequences
    ]


def test_an_id_reused_with_another_path_keeps_its_first_weights(lora, adapters):
    """vLLM's rule: an id names one adapter's weights; the same name and id with another path
    runs the weights first read for that id (a1's, not a2's)."""
    first = run(lora, PROMPTS[:2], adapters[0][0])
    reused = LoRARequest("a1", 1, adapters[1][0].lora_path)
    assert run(lora, PROMPTS[:2], reused) == first
    assert run(lora, PROMPTS[:2], adapters[1][0]) != first  # a2's own weights differ
