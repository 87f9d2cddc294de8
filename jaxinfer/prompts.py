"""`Prompts`: the tokenizer's side of a front end (`LLM`, and the server's API process, which
holds no engine): prompts in any accepted form -> token ids, chat templates, ids -> text. Host
side, no JAX (vLLM's ``InputPreprocessor``)."""

from collections.abc import Sequence as Seq

import numpy as np

from jaxinfer.checks import is_int
from jaxinfer.sampling_params import SamplingParams

ParamsArg = SamplingParams | Seq[SamplingParams] | None
GENERATION_DEFAULTS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)  # generation_config.json keys vLLM takes as defaults


def _is_ids_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.ndim == 1 and np.issubdtype(x.dtype, np.integer)


def _token_ids(ids, what: str) -> list[int]:
    """``ids`` (a list/tuple of ints or a 1-D integer array) as Python ints. Raises ValueError:
    anything else (str, float, bool, None and nested items are rejected, not converted)."""
    if isinstance(ids, np.ndarray) and not _is_ids_array(ids):
        raise ValueError(
            f"{what} must be a 1-D integer array or a list of ints; got an "
            f"array of shape {ids.shape} and dtype {ids.dtype}"
        )
    if not isinstance(ids, (list, tuple, np.ndarray)):
        raise ValueError(f"{what} must be a list of ints; got {type(ids).__name__}")
    if not isinstance(ids, np.ndarray) and (bad := [t for t in ids if not is_int(t, numpy=True)]):
        raise ValueError(
            f"{what} must be a list of ints; it holds {bad[0]!r} ({type(bad[0]).__name__})"
        )
    return [int(t) for t in ids]


def _normalize(prompts, sp: ParamsArg) -> tuple[list, list[SamplingParams]]:
    """(prompts, one SamplingParams per prompt). Raises ValueError: prompts not a prompt or an
    iterable of them; sampling_params not a SamplingParams or a list of them; counts differ."""
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise ValueError(
            f"prompts must be a str, a list of token ids, a dict, or a list of "
            f"these; got {type(prompts).__name__}"
        )
    single = (
        isinstance(prompts, (str, dict))
        or _is_ids_array(prompts)
        or (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(t, (int, np.integer)) for t in prompts)
        )
    )
    plist = [prompts] if single else list(prompts)
    if isinstance(sp, SamplingParams):
        return plist, [sp] * len(plist)
    bad = None if isinstance(sp, (list, tuple)) else type(sp).__name__
    bad = bad or next(
        (f"a list holding {type(p).__name__}" for p in sp if not isinstance(p, SamplingParams)),
        None,
    )
    if bad:
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them; got {bad}")
    if len(sp) != len(plist):
        raise ValueError(
            f"got {len(sp)} SamplingParams for {len(plist)} prompts; give one, or one per prompt"
        )
    return plist, list(sp)


class Prompts:
    """Prompt handling over ``self.tokenizer`` (an HF tokenizer, or None: token-id prompts only)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer, self.generation_config = tokenizer, {}  # generation_config.json's

    def _detokenize(
        self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        return self.tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: `SamplingParams` with the fields the model's generation_config.json sets
        (`GENERATION_DEFAULTS`; max_new_tokens as max_tokens), else ``SamplingParams()``."""
        return SamplingParams(
            **{
                "max_tokens" if k == "max_new_tokens" else k: v
                for k, v in self.generation_config.items()
                if k in GENERATION_DEFAULTS and v is not None
            }
        )

    def _encode(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt. Raises ValueError: no tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer, but this LLM has no tokenizer "
                "(skip_tokenizer_init=True, or LLM.from_params); pass "
                "{'prompt_token_ids': [...]} instead"
            )
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        tokenize: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[int] | str:
        """Ids (``tokenize=False``: the text) of ``messages`` (and OpenAI-style ``tools``, for
        templates that show them) in ``chat_template`` (None: the tokenizer's), by HF
        ``apply_chat_template`` with vLLM's `LLM.chat` arguments (``chat_template_kwargs`` go to
        the template, overriding the others); ValueError: no template, or it fails."""
        if self.tokenizer is None or not (
            chat_template or getattr(self.tokenizer, "chat_template", None)
        ):
            raise ValueError("this model's tokenizer has no chat template; use plain prompts")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                **dict(
                    tools=tools,
                    chat_template=chat_template,
                    continue_final_message=continue_final_message,
                    add_generation_prompt=add_generation_prompt,
                )
                | (chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors: a message without "role"/"content", etc.
            raise ValueError(
                f"the chat template rejected the messages: {type(e).__name__}: {e}; "
                'each message needs {"role": ..., "content": ...}'
            ) from None
        return self._encode(text, add_special_tokens=False) if tokenize else text

    def _to_ids(self, prompt) -> list[int]:
        if isinstance(prompt, dict):
            if other := sorted(set(prompt) - {"prompt", "prompt_token_ids"}, key=str):
                raise ValueError(
                    f"a dict prompt may hold 'prompt' and 'prompt_token_ids' "
                    f"(jaxinfer.inputs); {other} are not supported"
                )
            if "prompt_token_ids" in prompt:
                return _token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
            if "prompt" not in prompt:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            if not isinstance(prompt := prompt["prompt"], str):
                raise ValueError(f"'prompt' must be a str; got {type(prompt).__name__}")
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates, e.g. undecodable bytes in argv
                raise ValueError(
                    f"prompt is not valid Unicode text: {e.reason} at character {e.start}"
                ) from None
            return self._encode(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)):  # ndarray: 1-D integer only
            return _token_ids(prompt, "a token-id prompt")
        raise ValueError(
            f"a prompt must be a str, a list of token ids or a dict; got {type(prompt).__name__}"
        )

    def _prepare(self, prompts, sampling_params: ParamsArg, raise_errors: bool, check=None):
        """(params, [(text or None, ids)], {index: error}); ``raise_errors``: ValueError instead.
        ``check(ids, params)``: raises ValueError for a request that cannot run (`LLM`: its
        engine's `check_request`; None: the server's core checks); None params: the defaults."""
        plist, params = _normalize(
            prompts,
            self.get_default_sampling_params() if sampling_params is None else sampling_params,
        )
        encoded, errors = [], {}
        for i, (p, sp) in enumerate(zip(plist, params)):
            text = p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None
            ids = []  # a rejected request keeps what was read of it
            try:
                ids = self._to_ids(p)
                if check is not None:
                    check(ids, sp)
                if sp.stop and self.tokenizer is None:
                    raise ValueError(
                        f"SamplingParams.stop={list(sp.stop)!r} needs detokenized "
                        "text, but this LLM has no tokenizer; use stop_token_ids"
                    )
            except ValueError as e:
                errors[i] = str(e)
            encoded.append((text if isinstance(text, str) else None, ids))
        if errors and raise_errors:
            raise ValueError("; ".join(f"request {i}: {m}" for i, m in errors.items()))
        return params, encoded, errors
