"""`LLM`: the offline-inference API (vLLM's names: `LLM.generate`, `SamplingParams`,
`RequestOutput`)."""

import dataclasses
import os
from collections.abc import Callable

import jax
from tqdm import tqdm

from checkpoints_tools.default_model import default_model_path
from checkpoints_tools.hub import resolve_model, resolve_path
from checkpoints_tools.loader import load_tokenizer, open_checkpoint, read_json
from jaxinfer.beam_search import beam_search
from jaxinfer.checks import check_priority
from jaxinfer.config import ModelConfig, check_platform, engine_config, memory, resolve
from jaxinfer.config.vllm_args import VLLM_HUB
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.lora.request import per_prompt
from jaxinfer.models.quantize import is_quantized
from jaxinfer.models.smoothquant import fold, served_params
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.prompts import ParamsArg, Prompts
from jaxinfer.runner import loading, parallel
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.sampling_params import RequestOutputKind

PROFILER_DIR_ENV = "JAXINFER_PROFILER_DIR"  # `LLM.start_profile`'s default directory


@dataclasses.dataclass(frozen=True)
class Metric:
    """One entry of `LLM.get_metrics` (vLLM's ``vllm.v1.metrics.reader`` names): a `Counter`,
    a `Gauge` or a `Vector`."""

    name: str
    labels: dict


@dataclasses.dataclass(frozen=True)
class Counter(Metric):
    """A `Metric` that only grows."""

    value: int


@dataclasses.dataclass(frozen=True)
class Gauge(Metric):
    """A `Metric` that is a level now."""

    value: float


@dataclasses.dataclass(frozen=True)
class Vector(Metric):
    """Counters in order, one per draft position (vLLM's, for
    ``vllm:spec_decode_num_accepted_tokens_per_pos`` only)."""

    values: list[int]


_METRICS = (  # vLLM's names where the engine has the same counter
    (Gauge, "vllm:num_requests_running", lambda s: s.num_running),
    (Gauge, "vllm:num_requests_waiting", lambda s: s.num_waiting),
    (Gauge, "vllm:kv_cache_usage_perc", lambda s: s.kv_pages_in_use / max(s.kv_pages_total, 1)),
    (Counter, "vllm:prefix_cache_queries", lambda s: s.prefix_cache_queries),
    (Counter, "vllm:prefix_cache_hits", lambda s: s.prefix_cache_hits),
    (Counter, "vllm:spec_decode_num_drafts", lambda s: s.spec_num_drafts),
    (Counter, "vllm:spec_decode_num_draft_tokens", lambda s: s.spec_num_draft_tokens),
    (Counter, "vllm:spec_decode_num_accepted_tokens", lambda s: s.spec_num_accepted_tokens),
    (Vector, "vllm:spec_decode_num_accepted_tokens_per_pos", lambda s: s.spec_accepted_per_pos),
    (Counter, "jaxinfer:num_steps", lambda s: s.num_steps),
    (Gauge, "jaxinfer:compiled_step_shapes", lambda s: s.num_compiles),
)


def _claim_gpu_memory(utilization: float) -> None:
    """vLLM's ``gpu_memory_utilization`` as ``XLA_PYTHON_CLIENT_MEM_FRACTION``, if unset and no
    JAX backend has started (else `memory.card_bytes_usable` checks what the allocator got)."""
    from jax._src import xla_bridge  # JAX 0.10-0.11 has no public "backends started" test

    if not getattr(xla_bridge, "backends_are_initialized", lambda: True)():
        os.environ.setdefault(memory.XLA_MEM_FRACTION_ENV, str(utilization))


class LLM(Prompts):
    """A model served with continuous batching. ``model``: an HF model directory, a GGUF file, an
    Orbax directory or a Hugging Face hub id (`checkpoints_tools.hub.resolve_path`: vLLM's
    ``revision``, ``download_dir``, ``hf_token``, ``HF_HUB_OFFLINE``); None: the embedded
    SmolLM2-135M-Instruct. ``tokenizer``: an HF tokenizer directory, GGUF file or hub id
    (``tokenizer_revision``) instead of the model's. ``skip_tokenizer_init``: token-id prompts,
    no output text. ``hf_overrides``: a dict over the model's config.json (Orbax: `ModelConfig`
    fields). ``engine_args``: `EngineConfig` fields and vLLM's arguments (`engine_config`).
    FileNotFoundError: no such model or tokenizer (a hub id: the hub's error, the id named);
    ValueError: unsupported architecture, bad engine argument, GPU kernels off GPU."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        hf_overrides: dict | None = None,
        **engine_args,
    ):
        hub = {k: engine_args.pop(k, None) for k in VLLM_HUB}
        ec = engine_config(**engine_args)
        if not isinstance(hf_overrides, (dict, type(None))):  # vLLM's callable edits an HF config
            raise ValueError(
                f"hf_overrides must be a dict of config.json keys; got {hf_overrides!r}"
            )
        if ec.gpu_memory_utilization is not None:
            _claim_gpu_memory(ec.gpu_memory_utilization)
        platform = jax.default_backend()
        check_platform(ec.kernels, platform)  # before any file is read
        path, tokenizer = resolve_model(
            model if model is not None else default_model_path(), tokenizer, **hub
        )
        ckpt = open_checkpoint(path)  # once
        if hf_overrides:
            ckpt = dataclasses.replace(ckpt, config={**ckpt.config, **hf_overrides})
        gen = os.path.join(ckpt.path, "generation_config.json")
        self.generation_config = read_json(gen) if os.path.isfile(gen) else {}
        resolved = resolve(
            ModelConfig.from_checkpoint(ckpt), ec, platform, jax.devices()[0].device_kind
        )
        if ec.tensor_parallel_size > 1:
            parallel.make_mesh(ec.tensor_parallel_size)  # enough devices, before the weights
        loaded = loading.load_model(
            ckpt,
            resolved.dtype,
            with_tokenizer=not skip_tokenizer_init,
            tokenizer=tokenizer,
            quantization=None if resolved.smoothquant else resolved.quantization,
            on_host=ec.tensor_parallel_size > 1,
        )  # tp > 1: engine shards; SmoothQuant: quantised after it
        self.model_path, self.tokenizer = os.fspath(path), loaded.tokenizer
        resolved = dataclasses.replace(resolved, model=loaded.config)
        params, self._smoothing = served_params(
            loaded.params, loaded.config, resolved, loaded.tokenizer
        )
        runner = ModelRunner(loaded.config, params, resolved)
        self.engine = LLMEngine(
            runner,
            eos_token_ids=loaded.eos_token_ids,
            detokenize=None if skip_tokenizer_init else self._detokenize,
            tokenizer=self.tokenizer,
        )

    @classmethod
    def from_params(cls, config, params: dict, *, tokenizer=None, **engine_args) -> "LLM":
        """An `LLM` over ``params``, the `jaxinfer.models.init_params` tree of ``config`` (compute
        dtype; ``tensor_parallel_size`` > 1: jax or numpy leaves, resharded), quantised first with
        ``quantization="fp8"`` (W8A8: SmoothQuant before, given a tokenizer; `served_params`).
        ``tokenizer``: an HF tokenizer object, or a path or hub id as `LLM`'s; its EOS id joins
        ``config.eos_token_ids``; None: token-id prompts, no ``stop``. ValueError: ``config`` not
        a `ModelConfig`, a bad engine argument, a ``revision`` (no model is read);
        FileNotFoundError: no tokenizer."""
        if not isinstance(config, ModelConfig):
            raise ValueError(
                f"config must be a jaxinfer.config.ModelConfig; got "
                f"{type(config).__name__} (ModelConfig.from_dict builds one)"
            )
        self = cls.__new__(cls)
        self.generation_config, self.model_path = {}, None
        hub = {k: engine_args.pop(k, None) for k in VLLM_HUB}
        if hub.pop("revision") is not None:
            raise ValueError("revision names a model's hub revision; from_params reads no model")
        if isinstance(tokenizer, (str, os.PathLike)):
            path = resolve_path(
                tokenizer,
                what="tokenizer",
                revision=hub["tokenizer_revision"],
                download_dir=hub["download_dir"],
                token=hub["hf_token"],
            )
            tokenizer = load_tokenizer(path, "gguf" if path.endswith(".gguf") else "hf")
        self.tokenizer = tokenizer
        resolved = resolve(
            config,
            engine_config(**engine_args),
            jax.default_backend(),
            jax.devices()[0].device_kind,
        )
        params, self._smoothing = served_params(params, config, resolved, tokenizer)
        eos = (getattr(tokenizer, "eos_token_id", None), *config.eos_token_ids)
        self.engine = LLMEngine(
            ModelRunner(config, params, resolved),
            tokenizer=tokenizer,
            eos_token_ids=tuple(dict.fromkeys(t for t in eos if t is not None)),
            detokenize=None if tokenizer is None else self._detokenize,
        )
        return self

    def update_params(self, params) -> None:
        """`LLMEngine.update_params`: new weights, no recompile (ValueError: mismatch, requests);
        an unquantised tree gets the start's SmoothQuant factors folded in (`smoothquant.fold`)."""
        if self._smoothing is not None and not is_quantized(params):
            params = fold(params, self.engine.model_config, self._smoothing)
        self.engine.update_params(params)

    def update_lora(self, name_or_id, tensors: dict) -> None:
        """Replace loaded adapter ``name_or_id``'s (its ``lora_name`` or ``lora_int_id``) weights
        with a trainer's ``tensors`` (PEFT names, e.g. ``get_peft_model_state_dict``'s; numpy,
        torch or JAX arrays) in place, as `update_params` does for the base weights: no
        recompile (`LLMEngine.update_lora`; ValueError: unknown adapter, mismatch, requests)."""
        self.engine.update_lora(name_or_id, tensors)

    def generate(
        self,
        prompts,
        sampling_params: ParamsArg = None,
        *,
        use_tqdm: bool = False,
        on_error: str = "raise",
        stream: Callable[[int, list[int], str], None] | None = None,
        priority: list[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Outputs of ``prompts`` (a str, token ids, a `jaxinfer.inputs` TextPrompt or
        TokensPrompt, or a list of these) in input order; ``sampling_params``: one, or one per
        prompt (default `get_default_sampling_params`). ``on_error``: "raise": ValueError naming
        each invalid request before any runs; "return": those come back with ``error`` set (finish
        reason "error"). ``stream(index, new_token_ids, text_delta)`` as tokens arrive.
        ``priority``: vLLM's, None or one int per prompt, all 0 (first-come scheduling only; else
        ValueError, `check_priority`). A ``max_tokens`` beyond the room left in ``max_model_len``
        generates until the context is full (finish reason "length"), as vLLM's.
        ``lora_request``: a `LoRARequest` for every prompt, or a list of one (or None) per
        prompt (`per_prompt`; ValueError: as `LLMEngine.add_request`; with "return", a request
        whose adapter is refused comes back with ``error`` set)."""
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error={on_error!r} is invalid: allowed 'raise', 'return'")
        params, encoded, errors = self._prepare(
            prompts, sampling_params, on_error == "raise", self.engine.check_request
        )
        check_priority(priority, len(encoded))
        loras = per_prompt(lora_request, len(encoded))
        for i, lr in enumerate(loras if on_error == "return" else ()):
            try:  # a refused adapter fails its request only
                if i not in errors:
                    self.engine.lora.check(lr)
            except ValueError as e:
                errors[i] = str(e)
        outputs = self._run(
            {
                i: (ids, sp, loras[i])
                for i, ((_, ids), sp) in enumerate(zip(encoded, params))
                if i not in errors
            },
            [t for t, _ in encoded],
            use_tqdm,
            stream,
        )
        for i, msg in errors.items():
            outputs[i] = RequestOutput(
                f"rejected-{i}",
                encoded[i][0],
                list(encoded[i][1]),
                [CompletionOutput(0, "", [], "error")],
                True,
                error=msg,
                lora_request=loras[i],
            )
        return [outputs[i] for i in range(len(encoded))]

    def _run(
        self, requests: dict[int, tuple], texts: list, use_tqdm: bool, stream
    ) -> dict[int, RequestOutput]:
        """Add ``requests`` ({index: (ids, params, lora_request)}), step until done; exceptions
        abort them all."""
        bar = tqdm(
            total=len(requests),
            desc="generating",
            unit="req",
            disable=not (use_tqdm and len(requests) > 1),
        )
        outputs: dict[int, RequestOutput] = {}
        kind = RequestOutputKind.FINAL_ONLY if stream is None else RequestOutputKind.DELTA
        try:
            index_of = {
                self.engine.add_request(
                    ids, dataclasses.replace(sp, output_kind=kind), prompt=texts[i], lora_request=lr
                ): i
                for i, (ids, sp, lr) in requests.items()
            }
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    i = index_of[out.request_id]
                    for c in out.outputs if stream is not None else ():
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

    beam_search = beam_search  # vLLM's ``LLM.beam_search(prompts, params, lora_request, use_tqdm)``

    def precompile(
        self, prompts=None, sampling_params: ParamsArg = None, *, max_workers: int | None = None
    ) -> dict:
        """Compile, in parallel, every step shape the engine can take (`BucketSpec.planned`:
        no later request compiles a forward), or with ``prompts`` only the shapes
        ``generate(prompts, sampling_params)`` visits on an idle engine
        (`LLMEngine.plan_shapes`); returns {"planned", "shapes", "lower_s", "warm_s",
        "seconds"}. Raises ValueError: as `generate`; ``max_workers`` not >= 1."""
        if prompts is None and sampling_params is None:
            planned = self.engine.runner.buckets.planned()
            info = self.engine.precompile(None, max_workers=max_workers)
            return dict(planned=sum(map(len, planned.values())), **info)
        params, encoded, _ = self._prepare(
            prompts, sampling_params, True, self.engine.check_request
        )
        shapes = self.engine.plan_shapes([(ids, sp) for (_, ids), sp in zip(encoded, params)])
        return dict(planned=len(shapes), **self.engine.precompile(shapes, max_workers=max_workers))

    def chat(
        self,
        messages,
        sampling_params: ParamsArg = None,
        use_tqdm: bool = False,
        *,
        tools: list[dict] | None = None,
        on_error: str = "raise",
        stream=None,
        lora_request=None,
        **template,
    ) -> list[RequestOutput]:
        """`generate` on a conversation (a list of {"role", "content"} dicts) or a list of them,
        each in the chat template (`Prompts.apply_chat_template` with ``tools`` and ``template``,
        vLLM's ``chat_template``, ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``); ``RequestOutput.prompt``: the templated text."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.apply_chat_template(c, tools, tokenize=False, **template) for c in convs]
        return self.generate(
            [
                {"prompt": t, "prompt_token_ids": self._encode(t, add_special_tokens=False)}
                for t in texts
            ],
            sampling_params,
            use_tqdm=use_tqdm,
            on_error=on_error,
            stream=stream,
            lora_request=lora_request,
        )

    def encode(self, *args, **kwargs):
        """vLLM's ``LLM.encode`` is pooling (embeddings), which jaxinfer does not do: ValueError."""
        raise ValueError(
            "LLM.encode is vLLM's pooling (embeddings), which jaxinfer does not "
            "support; the token ids of a text: llm.get_tokenizer().encode(text)"
        )

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now (`_METRICS`; vLLM V1's ``get_metrics``); the
        speculative-decoding ones are there, zero, without ``speculative_config`` too, and the
        per-position `Vector` has ``num_speculative_tokens`` values (none without it)."""
        spec = self.engine.resolved.engine.speculative_config
        s = self.engine.stats()
        s.spec_accepted_per_pos = s.accepted_per_pos(spec.num_speculative_tokens if spec else 0)
        return [kind(name, {}, value(s)) for kind, name, value in _METRICS]

    def start_profile(self, profile_dir: str | None = None) -> None:
        """A `jax.profiler` trace into ``profile_dir``, else ``$JAXINFER_PROFILER_DIR`` (vLLM's
        ``VLLM_TORCH_PROFILER_DIR``) until `stop_profile`. ValueError: neither."""
        if not (path := profile_dir or os.environ.get(PROFILER_DIR_ENV)):
            raise ValueError(
                f"start_profile needs profile_dir or ${PROFILER_DIR_ENV} (a directory)"
            )
        jax.profiler.start_trace(path)

    def stop_profile(self) -> None:
        """End the trace `start_profile` began and write it (RuntimeError: none running)."""
        jax.profiler.stop_trace()

    def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache`: True, or False (no change) while a request holds
        pages."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: frees the KV pool's and the weights' device memory; level 1 keeps
        the weights on the host, level 2 discards them (`update_params` after `wake_up`).
        RuntimeError: requests unfinished, and for requests until `wake_up`; ValueError: level."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``LLM.wake_up``: ``tags`` (None: both) "weights" (level 1's back on the device),
        "kv_cache" (a new pool). Generation after it equals generation before."""
        self.engine.wake_up(tags)
