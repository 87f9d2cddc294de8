"""`LLM`: the offline-inference API (vLLM's names: `LLM.generate`, `SamplingParams`, `RequestOutput`)."""

import dataclasses
import os
from typing import Callable, Sequence as Seq

import jax
import numpy as np

from checkpoints_tools.loader import load_tokenizer, open_checkpoint
from jaxinfer.checks import is_int
from jaxinfer.config import EngineConfig, ModelConfig, check_platform, memory, resolve
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.models.quantize import quantize_params
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.runner import loading, parallel
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.sampling_params import RequestOutputKind, SamplingParams

_Params = SamplingParams | Seq[SamplingParams] | None


def _engine_config(engine_args: dict) -> EngineConfig:
    """Raises ValueError: an unknown argument (listing the allowed ones) or a bad value."""
    allowed = sorted(EngineConfig.__dataclass_fields__)
    if unknown := sorted(set(engine_args) - set(allowed)):
        raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {allowed}")
    return EngineConfig(**engine_args)


def _claim_gpu_memory(utilization: float) -> None:
    """vLLM's ``gpu_memory_utilization`` as ``XLA_PYTHON_CLIENT_MEM_FRACTION``, if unset and no
    JAX backend has started (else `memory.card_bytes_usable` checks what the allocator got)."""
    from jax._src import xla_bridge  # JAX 0.10-0.11 has no public "backends started" test

    started = getattr(xla_bridge, "backends_are_initialized", lambda: True)()
    if memory.XLA_MEM_FRACTION_ENV not in os.environ and not started:
        os.environ[memory.XLA_MEM_FRACTION_ENV] = str(utilization)


def _is_ids_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.ndim == 1 and np.issubdtype(x.dtype, np.integer)


def _token_ids(ids, what: str) -> list[int]:
    """``ids`` (a list/tuple of ints or a 1-D integer array) as Python ints. Raises ValueError:
    anything else (str, float, bool, None and nested items are rejected, not converted)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{what} must be a 1-D integer array or a list of ints; got an "
                             f"array of shape {ids.shape} and dtype {ids.dtype}")
    elif not isinstance(ids, (list, tuple)):
        raise ValueError(f"{what} must be a list of ints; got {type(ids).__name__}")
    elif bad := [t for t in ids if not is_int(t, numpy=True)]:
        raise ValueError(f"{what} must be a list of ints; it holds {bad[0]!r} "
                         f"({type(bad[0]).__name__})")
    return [int(t) for t in ids]


def _normalize(prompts, sampling_params: _Params) -> tuple[list, list[SamplingParams]]:
    """(prompts, one SamplingParams per prompt). Raises ValueError: prompts not a prompt or an
    iterable of them; sampling_params not a SamplingParams or a list of them; counts differ."""
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a str, a list of token ids, a dict, or a list of "
                         f"these; got {type(prompts).__name__}")
    single = isinstance(prompts, (str, dict)) or _is_ids_array(prompts) or (
        isinstance(prompts, (list, tuple)) and prompts
        and all(isinstance(t, (int, np.integer)) for t in prompts))
    plist = [prompts] if single else list(prompts)
    sp = SamplingParams() if sampling_params is None else sampling_params
    if isinstance(sp, SamplingParams):
        return plist, [sp] * len(plist)
    bad = None if isinstance(sp, (list, tuple)) else type(sp).__name__
    bad = bad or next((f"a list holding {type(p).__name__}" for p in sp
                       if not isinstance(p, SamplingParams)), None)
    if bad:
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them; got {bad}")
    if len(sp) != len(plist):
        raise ValueError(f"got {len(sp)} SamplingParams for {len(plist)} prompts; give one, or "
                         "one per prompt")
    return plist, list(sp)


class LLM:
    """A model served with continuous batching. ``model``: an HF model directory, a GGUF file or an
    Orbax directory; None: the embedded SmolLM2-135M-Instruct. ``tokenizer``: an HF tokenizer
    directory or GGUF file instead of the model's. ``skip_tokenizer_init``: token-id prompts, no
    output text. ``engine_args``: `EngineConfig` fields. FileNotFoundError: no such model or
    tokenizer; ValueError: unsupported architecture, bad engine argument, GPU kernels off GPU."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 skip_tokenizer_init: bool = False, **engine_args):
        from checkpoints_tools.default_model import default_model_path

        ec = _engine_config(engine_args)
        if ec.gpu_memory_utilization is not None:
            _claim_gpu_memory(ec.gpu_memory_utilization)
        platform = jax.default_backend()
        check_platform(ec.kernels, platform)  # before any file is read
        if tokenizer is not None and not os.path.exists(tokenizer):
            raise FileNotFoundError(f"tokenizer {tokenizer!r} does not exist")
        ckpt = open_checkpoint(model if model is not None else default_model_path())  # once
        resolved = resolve(ModelConfig.from_checkpoint(ckpt), ec, platform, jax.devices()[0].device_kind)
        if ec.tensor_parallel_size > 1:
            parallel.make_mesh(ec.tensor_parallel_size)  # enough devices, before the weights
        loaded = loading.load_model(ckpt, resolved.dtype, with_tokenizer=not skip_tokenizer_init,
                                    tokenizer=tokenizer, quantization=resolved.quantization,
                                    on_host=ec.tensor_parallel_size > 1)  # tp > 1: engine shards
        self.model_path, self.tokenizer = ckpt.path, loaded.tokenizer
        runner = ModelRunner(loaded.config, loaded.params,
                             dataclasses.replace(resolved, model=loaded.config))
        self.engine = LLMEngine(runner, eos_token_ids=loaded.eos_token_ids,
                                detokenize=None if skip_tokenizer_init else self._detokenize,
                                tokenizer=self.tokenizer)

    @classmethod
    def from_params(cls, config, params: dict, *, tokenizer=None, **engine_args) -> "LLM":
        """An `LLM` over ``params``, the `jaxinfer.models.init_params` tree of ``config`` (compute
        dtype; ``tensor_parallel_size`` > 1: jax or numpy leaves, resharded), quantised first with
        ``quantization="fp8"``. ``tokenizer``: an HF tokenizer object, or a path as `LLM`'s; its EOS
        id joins ``config.eos_token_ids``; None: token-id prompts, no ``stop``. ValueError:
        ``config`` not a `ModelConfig`, a bad engine argument; FileNotFoundError: no tokenizer."""
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a jaxinfer.config.ModelConfig; got "
                             f"{type(config).__name__} (ModelConfig.from_dict builds one)")
        self = cls.__new__(cls)
        if isinstance(tokenizer, (str, os.PathLike)):
            if not os.path.exists(tokenizer):
                raise FileNotFoundError(f"tokenizer {os.fspath(tokenizer)!r} does not exist")
            tokenizer = load_tokenizer(tokenizer, "gguf" if os.fspath(tokenizer).endswith(
                ".gguf") else "hf")
        self.model_path, self.tokenizer = None, tokenizer
        resolved = resolve(config, _engine_config(engine_args), jax.default_backend(),
                           jax.devices()[0].device_kind)
        if resolved.quantization is not None:
            params = quantize_params(params, config.weight_block_size)
        eos = (getattr(tokenizer, "eos_token_id", None), *config.eos_token_ids)
        self.engine = LLMEngine(ModelRunner(config, params, resolved),
                                eos_token_ids=tuple(dict.fromkeys(t for t in eos if t is not None)),
                                detokenize=None if tokenizer is None else self._detokenize,
                                tokenizer=tokenizer)
        return self

    def _detokenize(self, ids, skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     spaces_between_special_tokens=spaces_between_special_tokens)

    def update_params(self, params) -> None:
        """`LLMEngine.update_params`: new weights, no recompile (ValueError: mismatch, requests)."""
        self.engine.update_params(params)

    def get_tokenizer(self):
        return self.tokenizer

    def encode(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt. Raises ValueError: no tokenizer."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, but this LLM has no tokenizer "
                             "(skip_tokenizer_init=True, or LLM.from_params); pass "
                             "{'prompt_token_ids': [...]} instead")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None
                            ) -> list[int]:
        """Ids of ``messages`` (and OpenAI-style ``tools``, for templates that show them) in the
        chat template plus generation prompt; ValueError: it fails."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use plain prompts")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # jinja errors: a message without "role"/"content", etc.
            raise ValueError(f"the chat template rejected the messages: {type(e).__name__}: {e}; "
                             'each message needs {"role": ..., "content": ...}') from None
        return self.encode(text, add_special_tokens=False)

    def _to_ids(self, prompt) -> list[int]:
        if isinstance(prompt, dict):
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
                raise ValueError(f"prompt is not valid Unicode text: {e.reason} at character "
                                 f"{e.start}") from None
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)):  # ndarray: 1-D integer only
            return _token_ids(prompt, "a token-id prompt")
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict; got "
                         f"{type(prompt).__name__}")

    def _prepare(self, prompts, sampling_params: _Params, raise_errors: bool):
        """(params, [(text or None, ids)], {index: error}); ``raise_errors``: ValueError instead."""
        plist, params = _normalize(prompts, sampling_params)
        errors: dict[int, str] = {}
        encoded = []
        for i, (p, sp) in enumerate(zip(plist, params)):
            text = p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None
            ids = []  # a rejected request keeps what was read of it
            try:
                ids = self._to_ids(p)
                self.engine.check_request(ids, sp)
                if sp.stop and self.tokenizer is None:
                    raise ValueError(f"SamplingParams.stop={list(sp.stop)!r} needs detokenized "
                                     "text, but this LLM has no tokenizer; use stop_token_ids")
            except ValueError as e:
                errors[i] = str(e)
            encoded.append((text if isinstance(text, str) else None, ids))
        if errors and raise_errors:
            raise ValueError("; ".join(f"request {i}: {m}" for i, m in errors.items()))
        return params, encoded, errors

    def generate(self, prompts, sampling_params: _Params = None, *, use_tqdm: bool = False,
                 on_error: str = "raise",
                 stream: Callable[[int, list[int], str], None] | None = None) -> list[RequestOutput]:
        """Outputs of ``prompts`` (a str, token ids, {"prompt": str}, {"prompt_token_ids": ids}, or
        a list of these) in input order; ``sampling_params``: one, or one per prompt (default
        ``SamplingParams()``). ``on_error``: "raise": ValueError naming each invalid request before
        any runs; "return": those come back with ``error`` set (finish reason "error").
        ``stream(index, new_token_ids, text_delta)`` as tokens arrive (deltas sum to the text)."""
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error={on_error!r} is invalid: allowed 'raise', 'return'")
        params, encoded, errors = self._prepare(prompts, sampling_params, on_error == "raise")
        outputs = self._run({i: (ids, sp) for i, ((_, ids), sp) in enumerate(zip(encoded, params))
                             if i not in errors}, [t for t, _ in encoded], use_tqdm, stream)
        for i, msg in errors.items():
            outputs[i] = RequestOutput(
                request_id=f"rejected-{i}", prompt=encoded[i][0], prompt_token_ids=tuple(encoded[i][1]),
                outputs=[CompletionOutput(0, "", (), "error")], finished=True, error=msg)
        return [outputs[i] for i in range(len(encoded))]

    def _run(self, requests: dict[int, tuple], texts: list, use_tqdm: bool,
             stream) -> dict[int, RequestOutput]:
        """Add ``requests`` ({index: (ids, params)}), step until done; exceptions abort them all."""
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="generating", unit="req",
                   disable=not (use_tqdm and len(requests) > 1))
        outputs: dict[int, RequestOutput] = {}
        kind = RequestOutputKind.FINAL_ONLY if stream is None else RequestOutputKind.DELTA
        try:
            index_of = {self.engine.add_request(ids, dataclasses.replace(sp, output_kind=kind),
                                                prompt=texts[i]): i
                        for i, (ids, sp) in requests.items()}
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    i = index_of[out.request_id]
                    if stream is not None:
                        for c in out.outputs:
                            if c.index == 0 and (c.token_ids or c.text):
                                stream(i, list(c.token_ids), c.text)
                    outputs[i] = outputs[i].add(out) if i in outputs else out
                    bar.update(out.finished)
        except BaseException:
            self.engine.abort_all()
            raise
        finally:
            bar.close()
        return outputs

    def precompile(self, prompts, sampling_params: _Params = None, *,
                   max_workers: int | None = None) -> dict:
        """Compile, in parallel, the step shapes ``generate(prompts, sampling_params)`` visits on
        an idle engine (`LLMEngine.plan_shapes`); returns {"planned", "shapes", "lower_s",
        "warm_s", "seconds"}. Raises ValueError: as `generate`; ``max_workers`` not >= 1."""
        params, encoded, _ = self._prepare(prompts, sampling_params, True)
        keys = self.engine.plan_shapes([(ids, sp) for (_, ids), sp in zip(encoded, params)])
        return dict(planned=len(keys), **self.engine.precompile(keys, max_workers=max_workers))

    def chat(self, messages, sampling_params: _Params = None, **kw) -> list[RequestOutput]:
        """`generate` on a conversation (a list of {"role", "content"} dicts) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in convs]
        return self.generate(prompts, sampling_params, **kw)

    def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache`: True, or False (no change) while a request holds pages."""
        return self.engine.reset_prefix_cache()
