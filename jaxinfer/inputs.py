"""Prompt types of `LLM.generate` (vLLM's ``vllm.inputs``): a str, token ids, or one of these
dicts; a dict with another key is refused (`jaxinfer.prompts`). Host side, no JAX."""

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized with the model's tokenizer (special tokens added)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt of token ids; ``prompt``: its text, given back as ``RequestOutput.prompt``."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
