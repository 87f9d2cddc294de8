"""Acceptance 7 and CASES C1, C2, C3: bad input through the API; the engine keeps serving (on
the tiny random model and its character-level tokenizer)."""

import re

import pytest

from jaxinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny):
    """These mechanics run on the tiny model (tests/e2e/conftest.py)."""
    return tiny


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_invalid_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_empty_prompt_rejected_next_succeeds(llm):
    """C2: [] and "" (no BOS added by this tokenizer) are rejected; the next request succeeds."""
    for empty in ([], ""):
        with pytest.raises(ValueError, match="0 tokens"):
            llm.generate(
                empty if empty == "" else {"prompt_token_ids": empty}, SamplingParams(max_tokens=4)
            )
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) >= 1 and out.error is None


def test_bad_request_in_batch_others_unchanged(llm):
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    good = ["The sky is", "Two plus two is"]
    alone = [list(llm.generate(p, sp)[0].token_ids) for p in good]
    outs = llm.generate([good[0], "", good[1], "x " * 600], sp, on_error="return")
    assert [list(outs[0].token_ids), list(outs[2].token_ids)] == alone
    assert outs[1].error and "0 tokens" in outs[1].error
    assert outs[3].error and "512" in outs[3].error  # names max_model_len
    assert outs[1].outputs[0].finish_reason == "error"
    with pytest.raises(ValueError, match="request 1"):
        llm.generate([good[0], ""], sp)
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_pages == bm.num_usable_pages


def small_llm(llm, **engine_args):
    """An engine of its own over the shared LLM's weights (no second checkpoint load)."""
    return LLM.from_params(
        llm.engine.model_config, llm.engine.runner.params, dtype="float32", **engine_args
    )


def test_length_admission_rule(llm):
    """C1: max_model_len 64. A prompt of 64 tokens or more is rejected; a max_tokens beyond the
    room left generates until the context is full, "length" (vLLM's offline semantics)."""
    small = small_llm(llm, max_model_len=64, max_num_seqs=4, num_pages=64)
    ids = [3 + i % 90 for i in range(100)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    out = small.generate({"prompt_token_ids": ids[:63]}, SamplingParams(max_tokens=1, **greedy))
    assert len(out[0].token_ids) == 1 and out[0].outputs[0].finish_reason == "length"
    outs = small.generate(
        [{"prompt_token_ids": ids[:n]} for n in (63, 60, 50)],
        SamplingParams(max_tokens=200, **greedy),
    )
    assert [(len(o.token_ids), o.outputs[0].finish_reason) for o in outs] == [
        (1, "length"),
        (4, "length"),
        (14, "length"),
    ]
    for n in (64, 65):
        with pytest.raises(ValueError) as e:
            small.generate({"prompt_token_ids": ids[:n]}, SamplingParams(max_tokens=1))
        assert f"{n} tokens" in str(e.value) and "max_model_len=64" in str(e.value)
    # nothing was ever written at a position >= 64
    assert 0 < small.engine.stats().max_kv_len_seen <= 64


def test_priority_must_be_zero_with_first_come_scheduling(llm):
    """vLLM's ``generate(priority=...)``: all zeros run; anything else is refused by value."""
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    outs = llm.generate(["The sky is", "Hi"], sp, priority=[0, 0])
    assert all(len(o.token_ids) == 2 for o in outs)
    for bad, needle in (
        ([0, 1], "priority 1 given, but priority scheduling is not supported"),
        ([0], "1 values for 2 prompts"),
        ("0", "a list of ints"),
        ([0, 0.5], "a list of ints"),
    ):
        with pytest.raises(
            ValueError, match=re.escape(f"priority={bad!r} is invalid: ") + ".*" + needle
        ):
            llm.generate(["The sky is", "Hi"], sp, priority=bad)
    assert not llm.engine.has_unfinished()


def test_pool_admission(llm):
    """C3: page 16, 8 usable pages (128 tokens): a 200-token prompt fails at once, a 10-token one
    completes."""
    small = small_llm(llm, max_model_len=512, max_num_seqs=4, page_size=16, num_pages=9)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = small.generate(
        [
            {"prompt_token_ids": [3 + i % 90 for i in range(200)]},
            {"prompt_token_ids": list(range(3, 13))},
        ],
        sp,
        on_error="return",
    )
    assert outs[0].error and "pages" in outs[0].error
    assert len(outs[1].token_ids) == 8
    with pytest.raises(
        ValueError, match=r"max_tokens=1000: needs 32 KV pages of 16 tokens \(512 tokens\)"
    ):
        small.generate({"prompt_token_ids": list(range(3, 13))}, SamplingParams(max_tokens=1000))
    bm = small.engine.block_manager
    assert bm.num_free_pages == bm.num_usable_pages == 8


def test_out_of_vocab_token_rejected(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [1, 2, 10**9]}, SamplingParams(max_tokens=2))


def test_invalid_unicode_prompt_is_a_per_request_error(llm):
    """A lone surrogate (what undecodable argv bytes become) is rejected; the neighbour
    completes."""
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    outs = llm.generate(["bad \ud800 text", "The sky is"], sp, on_error="return")
    assert outs[0].error and "Unicode" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 4
    with pytest.raises(ValueError, match="Unicode"):
        llm.generate("bad \ud800 text", sp)


def test_sampling_params_type_checked(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a"], {"temperature": 0})


def test_stop_token_id_out_of_vocab(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("Hi", SamplingParams(max_tokens=2, stop_token_ids=[10**9]))


def test_engine_survives_a_failing_stream_callback(llm):
    """An exception mid-generation (here from the stream callback) aborts that call's requests;
    the next call works and all pages are free."""
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [list(o.token_ids) for o in llm.generate(["One", "Two"], sp)]

    def boom(*_):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        llm.generate(["One", "Two"], sp, stream=boom)
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_pages == bm.num_usable_pages
    assert [list(o.token_ids) for o in llm.generate(["One", "Two"], sp)] == want


def test_stream_deltas_equal_final_text_with_stop_string(llm):
    """Streamed text never shows a stop string: the deltas add up to the final text."""
    prompt = "What is the capital of France?"
    full = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))[0].text
    stop = full[12:16]  # reached by greedy decoding
    got = {}
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=32, stop=[stop], temperature=0.0),
        stream=lambda i, _t, d: got.__setitem__(i, got.get(i, "") + d),
    )[0]
    assert out.outputs[0].stop_reason == stop
    assert got[0] == out.text == full[: full.index(stop)] and stop not in got[0]


@pytest.mark.skipif(__import__("jax").default_backend() == "gpu", reason="a CPU-host check")
@pytest.mark.parametrize(
    "spec, field",
    [
        ("decode=mosaic", "decode_attention='mosaic'"),
        ("prefill=triton", "prefill_attention='triton'"),
    ],
)
def test_gpu_kernel_on_cpu_fails_before_loading(spec, field, monkeypatch):
    """A GPU kernel on a CPU host is refused before the checkpoint is read (neither its config
    nor its weights), as a spec string or a KernelConfig."""
    from jaxinfer.config import KernelConfig, ModelConfig
    from jaxinfer.runner import loading

    def no_load(*a, **k):
        raise AssertionError("the model was read before the option was checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setattr(ModelConfig, "from_checkpoint", no_load)
    for kernels in (spec, KernelConfig.parse(spec)):
        with pytest.raises(ValueError, match=f"{field} is a GPU kernel"):
            LLM("/nonexistent/model", kernels=kernels)


def test_config_missing_key(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(tmp_path))
