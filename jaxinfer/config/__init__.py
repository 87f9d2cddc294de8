"""Frozen, validated configuration: `ModelConfig` (`jaxinfer.config.model`), `EngineConfig` (user
settings, vLLM meanings), `KernelConfig`; `resolve` makes "auto" concrete (`ResolvedConfig`). A bad
value raises ValueError naming the field, the value and what is allowed. No JAX."""

from __future__ import annotations  # the field types stay strings: `_check` and cli_args read them

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from jaxinfer.checks import is_int, is_number
from jaxinfer.config.model import ModelConfig, _check, _fail, check_tp
from jaxinfer.sampling_params import MAX_LOGPROBS
from pallas_kernels.paged_attention import registry
from pallas_kernels.sizes import is_pow2

KERNEL_ALIASES = {"decode": "decode_attention", "prefill": "prefill_attention"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
FP8_KV_DECODE = ("reference", "triton")  # decode variants validated on fp8 pages
_BUCKETS = ("batch_buckets", "token_buckets")
_DTYPE_ALIASES = {"auto": None, "float": "float32", "half": "float16"}  # vLLM's dtype names


def kernel_choices() -> dict[str, tuple[str, ...]]:
    """Allowed values of each string field of `KernelConfig` (attention: the kernel registry)."""
    return {
        "decode_attention": ("auto", *registry.DECODE),
        "prefill_attention": ("auto", *registry.PREFILL),
        "prefill_gemm": ("xla", "cublas"),
    }


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Kernel knobs (allowed: `kernel_choices`; `resolve` replaces "auto"): paged attention of
    decode (T == 1) / prefill steps; prefill_gemm (cublas: GPU); decode buckets of >=
    cublas_decode_min_batch rows use cuBLAS (None: XLA); batch_buckets / token_buckets: B / T."""

    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    prefill_gemm: str = "xla"
    cublas_decode_min_batch: int | None = 64
    batch_buckets: tuple[int, ...] = ()
    token_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(
            self,
            (
                *(
                    (name, allowed.__contains__, "allowed: " + ", ".join(map(repr, allowed)))
                    for name, allowed in kernel_choices().items()
                ),
                (
                    "cublas_decode_min_batch",
                    lambda m: m is None or is_int(m, 1),
                    "must be None or a positive integer",
                ),
                *(
                    (
                        name,
                        lambda b: (
                            isinstance(b, (tuple, list))
                            and all(is_int(x, 1) for x in b)
                            and list(b) == sorted(set(b))
                        ),
                        "must be a tuple of strictly increasing positive integers, "
                        "or () for the defaults",
                    )
                    for name in _BUCKETS
                ),
            ),
        )
        for name in _BUCKETS:
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def parse(cls, spec: str | KernelConfig) -> KernelConfig:
        """From ``"key=value,..."`` (e.g. ``"decode=mosaic,batch_buckets=1:2:4"``; keys: fields or
        `KERNEL_ALIASES`), or a `KernelConfig`. ValueError: no ``=``, bad/repeated key or value."""
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, str):
            raise ValueError(
                f"kernels={spec!r} is invalid: expected a KernelConfig or a 'key=value,...' string"
            )
        keys, kw = {f.name for f in dataclasses.fields(cls)}, {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            name = KERNEL_ALIASES.get(key, key)
            if not sep or name not in keys:
                raise ValueError(
                    f"kernels: {item!r} is invalid: expected key=value with key one "
                    f"of {sorted(keys | set(KERNEL_ALIASES))}"
                )
            if name in kw:
                raise ValueError(f"kernels: {name!r} is given twice in {spec!r}")
            try:
                kw[name] = (
                    (tuple(int(x) for x in value.split(":")) if value else ())
                    if name in _BUCKETS
                    else value
                    if name in kernel_choices()
                    else None
                    if value.lower() == "none"
                    else int(value)
                )
            except ValueError:
                _fail(
                    "KernelConfig",
                    name,
                    value,
                    "expected integers (buckets joined by ':'), "
                    "or 'none' for cublas_decode_min_batch",
                )
        return cls(**kw)

    @classmethod
    def help(cls) -> str:
        """The keys with their allowed values and defaults, for CLI help texts."""
        alias, choices = {v: k for k, v in KERNEL_ALIASES.items()}, kernel_choices()
        return "; ".join(
            f"{alias.get(f.name, f.name)}="
            + (
                "|".join(choices[f.name])
                if f.name in choices
                else "sizes joined by ':'"
                if f.name in _BUCKETS
                else "none|ROWS"
            )
            + (f" (default {f.default})" if f.default != () else " (default empty: engine's)")
            for f in dataclasses.fields(cls)
        )


def _user(default, help: str, **cli):  # a user setting, its help and argparse keywords
    return dataclasses.field(default=default, metadata=dict(help=help, **cli))


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """User settings (vLLM's meanings; see each ``help``); ``kernels``: a `KernelConfig` or str."""

    max_model_len: int | None = _user(
        None, "most tokens (prompt + generated) of one sequence; default: max_position_embeddings"
    )
    page_size: int = _user(16, "tokens per KV page, a power of 2")
    num_pages: int | None = _user(
        None,
        "KV pool size in pages, null page 0 included; default: "
        "sized from free device memory (memory.engine_pool_pages)",
    )
    memory_fraction: float = _user(
        0.9, "fraction of device memory JAX's allocator may use, for weights + KV pool"
    )
    gpu_memory_utilization: float | None = _user(
        None,
        "fraction of the whole GPU for weights + KV pool (vLLM's meaning; replaces "
        "memory_fraction; memory.engine_pool_pages)",
    )
    max_num_seqs: int = _user(64, "most sequences in one step")
    max_num_batched_tokens: int = _user(
        2048, "most prompt tokens in one prefill step (longer prompts are chunked)"
    )
    dtype: str | None = _user(
        None,
        "compute and KV dtype; default and 'auto': bfloat16 on GPU, "
        "float32 elsewhere; float16 (= 'half'): CPU only",
        choices=["auto", "float32", "bfloat16", "float16", "half"],
    )
    seed: int = _user(0, "base seed of unseeded requests")
    async_scheduling: bool = _user(
        True, "dispatch step n+1 before reading back step n's tokens (same outputs either way)"
    )
    compilation_cache_dir: str | None = _user(
        "auto",
        "JAX persistent compilation cache (process-wide): a later run with the same DIR "
        "loads the compiled steps; 'auto': JAX's own if set ($JAX_COMPILATION_CACHE_DIR), else "
        "$XDG_CACHE_HOME/jaxinfer/jax (~/.cache/...); 'none': off",
        metavar="DIR",
    )
    compile_in_background: bool = _user(
        False,
        "a step shape not compiled yet compiles in a thread while its steps run padded to a "
        "compiled shape that covers it (no stall; the server's default on a GPU)",
    )
    enable_prefix_caching: bool = _user(
        True,
        "reuse the KV pages of prompt prefixes already "
        "computed (full pages, chained hashes, LRU eviction)",
    )
    kv_cache_dtype: str = _user(
        "auto",
        "KV cache dtype; 'auto': the compute dtype; 'fp8' (= "
        "'fp8_e4m3'): float8_e4m3fn pages, half the bytes of bfloat16",
        choices=list(KV_CACHE_DTYPES),
    )
    calculate_kv_scales: bool = _user(
        True,
        "fp8 KV: at start, per layer and KV head, the means of K (after RoPE) and V over "
        "512 tokens of a calibration text; pages hold x - mean (SageAttention's smoothing; scales "
        "stay 1.0). Needs a tokenizer",
    )
    tensor_parallel_size: int = _user(1, "devices to shard the model over (tensor parallelism)")
    quantization: str | None = _user(
        None,
        "weights: 'fp8' (e4m3, per-output-channel scales); "
        "default: unquantised, but an FP8 checkpoint runs fp8",
        choices=["fp8"],
    )
    enforce_eager: bool = _user(
        False, "accepted for vLLM compatibility; no effect (steps are always compiled)"
    )
    max_logprobs: int = _user(
        MAX_LOGPROBS,
        "most log-probabilities a request may ask for per "
        f"token (logprobs, prompt_logprobs), at most {MAX_LOGPROBS}",
    )
    kernels: KernelConfig = KernelConfig()

    def __post_init__(self) -> None:
        positive, fraction, fields = (
            "must be a positive integer",
            "must be a number in (0, 1]",
            dataclasses.fields(self),
        )
        _check(
            self,
            (
                *(
                    (
                        f.name,
                        _optional(is_number) if "None" in f.type else is_number,
                        f"must be {'None or ' * ('None' in f.type)}a number",
                    )
                    for f in fields
                    if f.type.startswith("float")
                ),
                *(
                    (f.name, lambda v: isinstance(v, bool), "must be True or False")
                    for f in fields
                    if f.type == "bool"
                ),
                *(
                    (n, lambda v: is_int(v, 1), positive)
                    for n in (
                        "page_size",
                        "max_num_seqs",
                        "max_num_batched_tokens",
                        "tensor_parallel_size",
                    )
                ),
                ("max_model_len", _optional(lambda v: is_int(v, 1)), positive),
                ("page_size", is_pow2, "must be a power of two (8, 16, 32, 64, ...)"),
                (
                    "num_pages",
                    _optional(lambda v: is_int(v, 2)),
                    "must be an integer >= 2 (page 0 is the null page)",
                ),
                ("memory_fraction", lambda v: 0.0 < v <= 1.0, fraction),
                ("gpu_memory_utilization", _optional(lambda v: 0.0 < v <= 1.0), fraction),
                (
                    "dtype",
                    (None, "float32", "bfloat16", "float16", *_DTYPE_ALIASES).__contains__,
                    "allowed: None or 'auto' (bfloat16 on GPU, else float32), "
                    "'float32' (= 'float'), 'bfloat16', 'float16' (= 'half')",
                ),
                ("seed", is_int, "must be an integer"),
                (
                    "compilation_cache_dir",
                    _optional(lambda v: isinstance(v, (str, os.PathLike))),
                    "must be None, 'auto', 'none' or a path",
                ),
                (
                    "kv_cache_dtype",
                    KV_CACHE_DTYPES.__contains__,
                    "allowed: 'auto' (the compute dtype), 'fp8' or 'fp8_e4m3' (float8_e4m3fn)",
                ),
                ("quantization", (None, "fp8").__contains__, "allowed: None or 'fp8'"),
                (
                    "max_logprobs",
                    lambda v: is_int(v, 0) and v <= MAX_LOGPROBS,
                    f"must be an integer in [0, {MAX_LOGPROBS}]",
                ),
            ),
        )
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(self, "kernels", KernelConfig.parse(self.kernels))
        for name, limit in zip(_BUCKETS, ("max_num_seqs", "max_num_batched_tokens")):
            if (b := getattr(self.kernels, name)) and b[-1] < getattr(self, limit):
                _fail(
                    "KernelConfig",
                    name,
                    b,
                    f"the largest must be >= {limit}={getattr(self, limit)}",
                )


# vLLM `LLM` arguments that are not `EngineConfig` fields, as `engine_config` reads them
VLLM_ALIASES = {"block_size": "page_size", "num_gpu_blocks_override": "num_pages"}
VLLM_ONLY = {  # name: (the values allowed, why no other)
    **{
        k: (("auto", "generate"), "jaxinfer runs generative models only (no pooling)")
        for k in ("task", "runner")
    },
    "pipeline_parallel_size": ((1,), "one pipeline stage (tensor_parallel_size splits a model)"),
    "load_format": (("auto", "safetensors", "gguf"), "the format is read from the model path"),
    "logits_processors": (
        (None, []),
        "vLLM V1's logits-processor classes are not supported; give"
        " SamplingParams(logits_processors=[JAX fn(output_token_ids, logits)])",
    ),
}
VLLM_NO_EFFECT = {  # name: (values that mean vLLM's default, why any other value changes nothing)
    "trust_remote_code": ((False,), "no model code is loaded (the architectures are built in)"),
    "swap_space": ((4,), "preempted requests are recomputed, never swapped to host memory"),
    "disable_log_stats": ((True,), "LLM logs no statistics (LLM.get_metrics() returns them)"),
    "enable_chunked_prefill": ((None, True), "prompts over max_num_batched_tokens are chunked"),
    "compilation_config": ((None, {}), "each step shape is compiled by XLA (jax.jit)"),
    "tokenizer_mode": (("auto", "hf"), "the checkpoint's HF tokenizer is used"),
    **{
        k: ((None,), "the model is read from local files only, as they are")
        for k in ("revision", "tokenizer_revision", "download_dir", "hf_token")
    },
}


def engine_config(**args) -> EngineConfig:
    """The `EngineConfig` of `LLM`'s keyword arguments: its fields and the `VLLM_*` tables' (a
    `VLLM_NO_EFFECT` value other than vLLM's default: one warning line). ValueError: an unknown
    argument (the allowed ones named), a value not allowed, an alias disagreeing with its field."""
    known = {*EngineConfig.__dataclass_fields__, *VLLM_ALIASES, *VLLM_ONLY, *VLLM_NO_EFFECT}
    if unknown := sorted(set(args) - known):
        raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
    for alias, name in VLLM_ALIASES.items():
        if alias in args and args.setdefault(name, args[alias]) != args.pop(alias):
            raise ValueError(f"{alias} (vLLM's name of {name}) and {name} differ: give one")
    for name, (allowed, why) in VLLM_ONLY.items():
        if (v := args.pop(name, allowed[0])) not in allowed:
            raise ValueError(
                f"{name}={v!r} is invalid: {why}; allowed: " + ", ".join(map(repr, allowed))
            )
    for name, (silent, why) in VLLM_NO_EFFECT.items():
        if name in args and (v := args.pop(name)) not in silent:
            logging.getLogger("jaxinfer").warning("jaxinfer: %s=%r has no effect: %s", name, v, why)
    return EngineConfig(**args)


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """A model, its `EngineConfig` and a `KernelConfig` with no "auto" left (from `resolve`)."""

    model: ModelConfig
    engine: EngineConfig
    kernels: KernelConfig
    max_model_len: int
    dtype: str  # "float32" | "bfloat16"
    platform: str  # JAX backend: "cpu" | "gpu" | ...
    kv_dtype: str  # the KV pools': dtype or "float8_e4m3fn"
    quantization: str | None = None  # weights: None | "fp8"

    dtype_bytes = property(lambda self: DTYPE_BYTES[self.dtype])
    kv_dtype_bytes = property(lambda self: DTYPE_BYTES[self.kv_dtype])


def check_platform(kc: KernelConfig, platform: str) -> None:
    """Raise ValueError when ``kc`` names a GPU kernel and ``platform`` is not "gpu"."""
    for name in KERNEL_ALIASES.values():
        if platform != "gpu" and (value := getattr(kc, name)) not in ("auto", "reference"):
            raise ValueError(
                f"KernelConfig.{name}={value!r} is a GPU kernel and this host's JAX "
                f"backend is {platform!r}; use 'auto' or 'reference' here (the "
                "kernels' CPU tests run them in interpret mode)"
            )


def resolve(
    model: ModelConfig, engine: EngineConfig, platform: str, device_kind: str | None = None
) -> ResolvedConfig:
    """Every "auto"/None of ``engine`` for ``model`` on ``platform`` (JAX backend) made concrete. On
    "gpu": bfloat16, prefill triton, in half precision decode mosaic (fp8 KV: triton); else float32
    and reference; a variant not validated on ``device_kind`` falls back (`registry.for_device`,
    logged). max_model_len None: max_position_embeddings; quantization None: "fp8" for an FP8
    checkpoint; fp8 GEMMs stay on XLA (cuBLAS cannot fuse the e4m3 convert). ValueError:
    max_model_len above that, a GPU kernel off "gpu", float16 on "gpu", fp8 KV with a decode
    variant not in `FP8_KV_DECODE` or tp > 1, a tp the model cannot take."""
    max_len = engine.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        _fail(
            "EngineConfig",
            "max_model_len",
            max_len,
            f"the model supports at most max_position_embeddings={model.max_position_embeddings}",
        )
    dtype = engine.dtype or ("bfloat16" if platform == "gpu" else "float32")
    if dtype == "float16" and platform == "gpu":
        _fail(
            "EngineConfig",
            "dtype",
            dtype,
            "the GPU kernels are not validated in float16; use 'bfloat16'",
        )
    kc = engine.kernels
    check_platform(kc, platform)
    quant = engine.quantization or ("fp8" if model.weight_block_size else None)
    if engine.kv_cache_dtype != "auto" and (tp := engine.tensor_parallel_size) > 1:
        _fail(
            "EngineConfig",
            "tensor_parallel_size",
            tp,
            f"kv_cache_dtype="
            f"{engine.kv_cache_dtype!r} runs on one device only; use 1 or kv_cache_dtype='auto'",
        )
    check_tp(model, engine.tensor_parallel_size)
    gpu, half = platform == "gpu", dtype in ("bfloat16", "float16")
    kv_dtype = KV_CACHE_DTYPES[engine.kv_cache_dtype] or dtype
    fp8 = kv_dtype != dtype
    if fp8 and kc.decode_attention not in ("auto", *FP8_KV_DECODE):
        raise ValueError(
            f"KernelConfig.decode_attention={kc.decode_attention!r} is not validated "
            f"with fp8 KV (kv_cache_dtype={engine.kv_cache_dtype!r}); use one of "
            f"{('auto', *FP8_KV_DECODE)}"
        )
    auto = {
        "decode_attention": ("triton" if fp8 else "mosaic") if gpu and half else "reference",
        "prefill_attention": "triton" if gpu else "reference",
    }
    for k in (k for k in KERNEL_ALIASES.values() if getattr(kc, k) == "auto"):  # explicit: kept
        if (new := registry.for_device(auto[k], device_kind)) != auto[k]:
            logging.getLogger("jaxinfer").warning(
                "jaxinfer: %s=%r is not validated on %r; using %r", k, auto[k], device_kind, new
            )
            auto[k] = new
    kc = dataclasses.replace(
        kc,
        **{k: v for k, v in auto.items() if getattr(kc, k) == "auto"},
        **({"cublas_decode_min_batch": None} if quant else {}),
    )
    return ResolvedConfig(model, engine, kc, max_len, dtype, platform, kv_dtype, quant)
