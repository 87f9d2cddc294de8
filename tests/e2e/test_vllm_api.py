"""vLLM's offline API on the tiny model (issue 31: a vLLM script runs with only its imports
changed): `SamplingParams`' fields, `jaxinfer.inputs`, `LLM.chat`'s template arguments, the
outputs' fields, `LLM`'s methods and float16, each as vLLM behaves; then a vLLM user's script
(vllm_offline_script.py) end to end. The engine arguments: tests/engine/test_llm_inputs.py."""

import dataclasses
import json
import shutil

import pytest
from tiny_model import TINY_ENGINE

from jaxinfer import LLM, SamplingParams
from jaxinfer.inputs import TextPrompt, TokensPrompt
from jaxinfer.llm import PROFILER_DIR_ENV, Counter, Gauge
from jaxinfer.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
TEXT = "The capital of Japan is"


def test_sampling_params_fields(tiny):
    """vLLM's SamplingParams: ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens;
    ``detokenize=False`` gives token ids, no text; ``extra_args`` is kept as
    given (``bad_words``, ``allowed_token_ids``, ``logits_processors``:
    tests/engine/test_token_masks.py); the object is mutable and validated again when a request
    is added."""
    ids = tiny.get_tokenizer().encode(TEXT)
    sp = SamplingParams(
        temperature=0.0, max_tokens=5, truncate_prompt_tokens=8, extra_args={"tag": [1]}
    )
    cut, last8 = tiny.generate([ids, ids[-8:]], [sp, GREEDY])
    assert cut.prompt_token_ids == ids[-8:] and cut.token_ids == last8.token_ids
    assert sp.extra_args == {"tag": [1]} and sp.truncate_prompt_tokens == 8
    (quiet,) = tiny.generate([ids[-8:]], dataclasses.replace(GREEDY, detokenize=False))
    assert quiet.text == "" and quiet.token_ids == last8.token_ids and last8.text  # test_outputs
    sp.max_tokens, sp.truncate_prompt_tokens = 3, None
    assert (
        tiny.generate([ids], sp)[0].token_ids
        == tiny.generate([ids], dataclasses.replace(GREEDY, max_tokens=3))[0].token_ids
    )
    sp.max_tokens = 0
    with pytest.raises(ValueError, match="request 0: SamplingParams.max_tokens=0 is invalid"):
        tiny.generate([ids], sp)


def test_text_and_tokens_prompts(tiny):
    """vLLM's ``vllm.inputs``: TextPrompt(prompt=...) is tokenized as a str is;
    TokensPrompt(prompt_token_ids=...) runs as given, its optional ``prompt`` coming back as
    ``RequestOutput.prompt``; a key jaxinfer does not handle (multi_modal_data) is an error."""
    ids = tiny.get_tokenizer().encode(TEXT)
    a, b, c = tiny.generate(
        [
            TextPrompt(prompt=TEXT),
            TokensPrompt(prompt_token_ids=ids),
            TokensPrompt(prompt_token_ids=ids, prompt="given"),
        ],
        GREEDY,
    )
    assert (a.prompt, b.prompt, c.prompt) == (TEXT, None, "given") and a.prompt_token_ids == ids
    assert a.token_ids == b.token_ids == c.token_ids
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\] are not supported"):
        tiny.generate(TextPrompt(prompt=TEXT, multi_modal_data={}), GREEDY)


def test_chat_template_arguments(tiny):
    """vLLM's LLM.chat: ``chat_template`` replaces the tokenizer's, ``add_generation_prompt=False``
    leaves out the assistant header, ``continue_final_message=True`` continues the last message
    (with add_generation_prompt also True: an error, as HF's), ``chat_template_kwargs`` reach the
    template; ``RequestOutput.prompt`` is the templated text, its ids that text tokenized with
    no special tokens added."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    (cont,) = tiny.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello, I"
    assert cont.prompt_token_ids == tiny.get_tokenizer().encode(
        cont.prompt, add_special_tokens=False
    )
    assert tiny.chat(conv[:1], GREEDY)[0].prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="not compatible"):
        tiny.chat(conv, GREEDY, continue_final_message=True)
    own = (
        "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    outs = tiny.chat(
        [conv[:1], conv[:1]], GREEDY, chat_template=own, chat_template_kwargs={"greeting": "Yo"}
    )
    assert [o.prompt for o in outs] == ["Yo[Hi]>"] * 2
    assert (
        tiny.chat(conv[:1], GREEDY, chat_template=own, add_generation_prompt=False)[0].prompt
        == "[Hi]"
    )


def test_output_fields(tiny):
    """vLLM's RequestOutput and CompletionOutput: ``lora_request``, ``encoder_prompt``,
    ``encoder_prompt_token_ids`` and ``kv_transfer_params`` are None here;
    ``CompletionOutput.finished()`` says whether a finish reason is set; ``token_ids`` and
    ``prompt_token_ids`` are lists (vLLM V1's), equal to the lists users hold."""
    ids = tiny.get_tokenizer().encode(TEXT)
    (out,) = tiny.generate([ids], GREEDY)
    assert (
        out.lora_request,
        out.encoder_prompt,
        out.encoder_prompt_token_ids,
        out.kv_transfer_params,
    ) == (None,) * 4
    assert out.prompt_token_ids == ids and type(out.outputs[0].token_ids) is list
    assert out.outputs[0].finished() and out.finished
    tiny.engine.add_request(
        ids, dataclasses.replace(GREEDY, output_kind=RequestOutputKind.DELTA), request_id="fields"
    )
    deltas = []
    while tiny.engine.has_unfinished():
        deltas += tiny.engine.step()
    assert [d.outputs[0].finished() for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum((d.outputs[0].token_ids for d in deltas), []) == out.token_ids


def test_llm_methods(tiny, tmp_path, monkeypatch):
    """vLLM's LLM methods: ``get_default_sampling_params()`` is ``SamplingParams()`` without a
    generation_config.json (with one: test_vllm_offline_script); ``get_metrics()`` lists
    Counter and Gauge entries under vLLM V1's names (the spec_decode ones at zero without
    speculative_config); ``start_profile()``/``stop_profile()`` write a profiler trace into
    $JAXINFER_PROFILER_DIR (vLLM's VLLM_TORCH_PROFILER_DIR) or the directory given, and with
    neither say so; ``encode`` (vLLM's pooling) is refused, naming the tokenizer's encode."""
    assert tiny.get_default_sampling_params() == SamplingParams()
    before = {m.name: m for m in tiny.get_metrics()}
    assert isinstance(before["vllm:prefix_cache_queries"], Counter)
    assert isinstance(before["vllm:kv_cache_usage_perc"], Gauge)
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=PROFILER_DIR_ENV):
        tiny.start_profile()
    tiny.start_profile(str(tmp_path / "arg"))
    tiny.generate([TEXT], GREEDY)
    tiny.stop_profile()
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path / "env"))
    tiny.start_profile()
    tiny.stop_profile()
    for d in ("arg", "env"):
        assert list((tmp_path / d).rglob("*.xplane.pb")), d
    after = {m.name: getattr(m, "value", None) for m in tiny.get_metrics()}  # Vector: values
    assert after["vllm:prefix_cache_queries"] > before["vllm:prefix_cache_queries"].value
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["jaxinfer:num_steps"] > before["jaxinfer:num_steps"].value
    for name in ("drafts", "draft_tokens", "accepted_tokens"):  # no speculative_config: zeros
        assert isinstance(before[f"vllm:spec_decode_num_{name}"], Counter)
        assert after[f"vllm:spec_decode_num_{name}"] == 0
    assert before["vllm:spec_decode_num_accepted_tokens_per_pos"].values == []
    with pytest.raises(ValueError, match=r"pooling.*llm.get_tokenizer\(\)\.encode\(text\)"):
        tiny.encode(TEXT)


def test_float16_runs_on_the_cpu(tiny, tiny_text_cfg, tiny_text_params):
    """vLLM's ``dtype="half"`` (= "float16"): the compute and KV dtype. On the CPU it runs, and
    its greedy tokens match float32's on the tiny model (a GPU refuses it: test_llm_inputs)."""
    import jax

    half = LLM.from_params(
        tiny_text_cfg,
        jax.tree.map(lambda x: x.astype("float16"), tiny_text_params),
        tokenizer=tiny.get_tokenizer(),
        **dict(TINY_ENGINE, dtype="half"),
    )
    assert (half.engine.resolved.dtype, half.engine.resolved.kv_dtype) == ("float16",) * 2
    prompts = [TEXT, "def fibonacci(n):"]
    assert [o.token_ids for o in half.generate(prompts, GREEDY)] == [
        o.token_ids for o in tiny.generate(prompts, GREEDY)
    ]


def test_vllm_offline_script(tiny_checkpoint, tmp_path):
    """A vLLM user's offline script (vllm_offline_script.py), its imports changed only, runs end
    to end on the tiny model: ``LLM(...)`` with vLLM's arguments (block_size, swap_space,
    hf_overrides, ...), the model's generation_config.json as the default SamplingParams (vLLM's
    ``get_default_sampling_params``), SamplingParams mutated and cloned, TextPrompt and
    TokensPrompt, chat with template arguments, and the outputs' fields."""
    from e2e.vllm_offline_script import main

    model = shutil.copytree(tiny_checkpoint, tmp_path / "model")
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "max_new_tokens": 7, "do_sample": True})
    )
    run = main(str(model), kernels=TINY_ENGINE["kernels"])
    llm, (text, tokens) = run["llm"], run["outputs"]
    assert run["defaults"] == SamplingParams(temperature=0.6, top_k=20, max_tokens=7)
    ec = llm.engine.resolved
    assert (ec.max_model_len, ec.engine.page_size, ec.engine.num_pages) == (512, 16, 160)
    assert run["greedy"].max_tokens == 8 and run["sampled"].temperature == 0.8
    assert text.prompt == "Hello, my name is" and tokens.prompt is None
    assert len(tokens.outputs[0].token_ids) == 8 == len(tokens.outputs[0].logprobs)
    assert all(o.outputs[0].finished() and o.lora_request is None for o in run["outputs"])
    (chat,), (cont,) = run["chat"], run["continued"]
    assert chat.prompt == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert cont.prompt == chat.prompt + "I"
