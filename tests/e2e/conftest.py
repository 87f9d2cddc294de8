"""Shared fixtures for end-to-end tests: ``llm``, the real SmolLM2-135M-Instruct weights (float32,
CPU) for comparisons with HF transformers, and ``tiny``, the tiny random model with its
character-level tokenizer (tests/conftest.py) for the engine's mechanics, both with pages of 16
tokens and max_model_len 512.

The HF transformers reference loads the same GGUF file; its greedy outputs are computed once per
run of tests/e2e, one prompt at a time (no padding), and cached.
"""

import inspect
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PLAIN_PROMPTS = [
    "The capital of Japan is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me one word that rhymes with cat.",
]
PAGE_SIZE = 16


@pytest.fixture(scope="package")
def hf_model(hf_smollm):
    return hf_smollm  # tests/conftest.py: loaded once for the whole run


@pytest.fixture(scope="package")
def smollm_startup(smollm_path, smollm_engine):
    """(``llm``, how many times building it opened the GGUF file: test_startup_and_text.py)."""
    import builtins

    from jaxinfer import LLM

    real_open, opened = builtins.open, []

    def spy(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == smollm_path:
            opened.append(file)
        return real_open(file, *a, **k)

    builtins.open = spy
    try:
        llm = LLM(smollm_path, **smollm_engine)
    finally:
        builtins.open = real_open
    return llm, len(opened)


@pytest.fixture(scope="package")
def llm(smollm_startup):
    return smollm_startup[0]


@pytest.fixture(scope="package")
def tiny(tiny_llm):
    return tiny_llm(max_model_len=512, num_pages=160, max_compiles=TINY_COMPILES)


TINY_COMPILES = 60  # step shapes the e2e tests may compile on ``tiny``


class HFGreedy:
    """Greedy reference: HF generate on one unpadded prompt, stopping at EOS like our engine."""

    def __init__(self, model, eos_ids):
        self.model, self.eos_ids, self.cache = model, list(eos_ids), {}

    def __call__(self, ids, max_new_tokens, ignore_eos=False):
        import torch

        key = (tuple(ids), max_new_tokens, ignore_eos)
        if key not in self.cache:
            with torch.inference_mode():
                x = torch.tensor([list(ids)])
                if ignore_eos:  # plain argmax loop: EOS is sampled and decoding goes on
                    out, past, cur = [], None, x
                    name = (
                        "cache"
                        if "cache" in inspect.signature(self.model.forward).parameters
                        else "past_key_values"
                    )  # transformers >= 5.25: cache
                    for _ in range(max_new_tokens):
                        r = self.model(cur, use_cache=True, **{name: past})
                        past = getattr(r, name)
                        nxt = int(r.logits[0, -1].argmax())
                        out.append(nxt)
                        cur = torch.tensor([[nxt]])
                    self.cache[key] = out
                else:
                    y = self.model.generate(
                        x,
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        eos_token_id=self.eos_ids,
                        pad_token_id=self.eos_ids[0],
                    )
                    self.cache[key] = y[0, x.shape[1] :].tolist()
        return self.cache[key]


@pytest.fixture(scope="package")
def hf_greedy(hf_model, llm):
    return HFGreedy(hf_model, llm.engine.eos_token_ids)


@pytest.fixture(scope="package")
def tiny_prompt_ids(tiny):
    """The prompts of `prompt_ids`, tokenized by the tiny model's tokenizer."""
    plain = [tiny.get_tokenizer().encode(p) for p in PLAIN_PROMPTS]
    chat = [tiny.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return plain + chat


@pytest.fixture(scope="package")
def prompt_ids(llm):
    """Token ids of the plain prompts and of the chat prompts in the chat template."""
    plain = [llm.get_tokenizer().encode(p) for p in PLAIN_PROMPTS]
    chat = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return plain + chat


@pytest.fixture
def shared_llm(monkeypatch, tiny):
    """The CLI in this process gets the shared tiny `LLM` (max_model_len 512, its
    character-level tokenizer) instead of loading one: these tests are about the CLI's mechanics."""
    import jaxinfer.llm

    monkeypatch.setattr(jaxinfer.llm, "LLM", lambda *a, **k: tiny)
    return tiny
