"""`LLM()` on the SmolLM2 GGUF reads the file once (config, weights and tokenizer from one parse),
and the per-request text options on real weights match HF's ``tokenizer.decode`` (an
``AutoTokenizer`` built by transformers from the file: an independent reference)."""

import os

import pytest

from jaxinfer import SamplingParams


@pytest.fixture(scope="module")
def startup(smollm_startup):
    """(the shared SmolLM2 `LLM`, number of times the GGUF file was opened while it was built:
    tests/e2e/conftest.py)."""
    return smollm_startup


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    d, f = os.path.split(smollm_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f, local_files_only=True)


def test_gguf_is_opened_once_and_the_tokenizer_matches_hf(startup, hf_tokenizer):
    llm, opened = startup
    assert opened == 1
    tok = llm.get_tokenizer()
    for text in ["Hello world", "<|im_start|>user\nHi<|im_end|>", "안녕하세요 😀", "  a\n\tb"]:
        assert tok.encode(text) == hf_tokenizer.encode(text)
    assert llm.get_tokenizer().encode("<|im_start|>x") == hf_tokenizer.encode("<|im_start|>x")
    msgs = [{"role": "user", "content": "hi"}]
    assert llm.apply_chat_template(msgs) == hf_tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_special_tokens_and_stop_string_in_text(startup, hf_tokenizer):
    llm, _ = startup
    prompt = {
        "prompt_token_ids": llm.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
    }
    greedy = dict(temperature=0.0, max_tokens=40)
    keep, drop, eos = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(skip_special_tokens=False, **greedy),
            SamplingParams(**greedy),
            SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True, **greedy),
        ],
    )
    ids = list(keep.token_ids)
    assert keep.outputs[0].finish_reason == "stop" and ids == list(drop.token_ids)
    # vLLM: the EOS that stopped the request is left out unless include_stop_str_in_output
    assert keep.text == hf_tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert eos.text == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert eos.text.endswith("<|im_end|>") and drop.text == hf_tokenizer.decode(
        ids, skip_special_tokens=True
    )
    stop = drop.text.split()[1]  # a word inside the answer
    cut, kept = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(stop=[stop], **greedy),
            SamplingParams(stop=[stop], include_stop_str_in_output=True, **greedy),
        ],
    )
    head = drop.text[: drop.text.find(stop)]
    assert (cut.text, kept.text) == (head, head + stop)
    assert cut.outputs[0].stop_reason == kept.outputs[0].stop_reason == stop
