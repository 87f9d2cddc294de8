"""`EngineConfig`: the user settings, with vLLM's meanings (each field's ``help`` is its CLI help
text). No JAX."""

from __future__ import annotations  # the field types stay strings: `_check` and cli_args read them

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from jaxinfer.checks import is_int, is_number
from jaxinfer.config.kernels import _BUCKETS, KernelConfig
from jaxinfer.config.model import _check, _fail
from jaxinfer.config.speculative import SpeculativeConfig
from jaxinfer.sampling_params import MAX_LOGPROBS
from pallas_kernels.sizes import is_pow2

KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
_DTYPE_ALIASES = {"auto": None, "float": "float32", "half": "float16"}  # vLLM's dtype names


def _user(default, help: str, **cli):  # a user setting, its help and argparse keywords
    return dataclasses.field(default=default, metadata=dict(help=help, **cli))


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


def _typed_rules(fields) -> tuple:
    """The checks every float field (None allowed where its type says) and bool field gets."""
    return (
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
    )


def _rules() -> tuple:
    """`EngineConfig`'s field checks for `_check`: (field, ok(value), what is allowed)."""
    positive, fraction = "must be a positive integer", "must be a number in (0, 1]"
    return (
        *_typed_rules(dataclasses.fields(EngineConfig)),
        *(
            (n, lambda v: is_int(v, 1), positive)
            for n in (
                "page_size",
                "max_num_seqs",
                "max_num_batched_tokens",
                "tensor_parallel_size",
                "max_loras",
                "max_lora_rank",
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
        ("smoothquant", _optional(lambda v: 0 <= v <= 1), "must be None or a number in [0, 1]"),
        (
            "max_logprobs",
            lambda v: is_int(v, 0) and v <= MAX_LOGPROBS,
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        ),
    )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """User settings (vLLM's meanings; see each ``help``); ``kernels``: a `KernelConfig` or str;
    ``speculative_config``: None, a `SpeculativeConfig`, a dict or a JSON string of one
    (`SpeculativeConfig.from_value`), kept as a `SpeculativeConfig` or None."""

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
    precompile: bool = _user(
        False,
        "compile every planned step shape at start (LLM.precompile()): no request ever waits "
        "for a forward compile (the server's default on a GPU)",
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
    smoothquant: float | None = _user(
        None,
        "fp8 weights (quantization fp8): SmoothQuant's migration strength alpha in [0, 1] "
        "(TensorRT-LLM's --smoothquant), folded into the weights at load from 512 tokens of a "
        "calibration text (needs a tokenizer; one device, no LoRA); default: 0.4 with kernels "
        "fp8_gemm=w8a8, else off; 0: off (docs/fp8.md)",
        metavar="ALPHA",
    )
    enforce_eager: bool = _user(
        False, "accepted for vLLM compatibility; no effect (steps are always compiled)"
    )
    max_logprobs: int = _user(
        MAX_LOGPROBS,
        "most log-probabilities a request may ask for per "
        f"token (logprobs, prompt_logprobs), at most {MAX_LOGPROBS}",
    )
    speculative_config: SpeculativeConfig | None = _user(
        None,
        "speculative decoding (vLLM's speculative_config), a JSON object: method ('ngram', "
        "'draft_model', 'eagle3'), num_speculative_tokens (required), model (draft_model, "
        "eagle3), prompt_lookup_max/min (ngram), disable_by_batch_size; e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (docs/speculative_decoding.md)',
        metavar="JSON",
    )
    enable_lora: bool = _user(
        False, "serve LoRA adapters (generate(..., lora_request=LoRARequest(...)); docs/lora.md)"
    )
    max_loras: int = _user(1, "LoRA adapters on the device at once (slots; LRU eviction)")
    max_lora_rank: int = _user(16, "largest LoRA rank r an adapter may have (slots padded to it)")
    kernels: KernelConfig = KernelConfig()

    def __post_init__(self) -> None:
        _check(self, _RULES)
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(self, "kernels", KernelConfig.parse(self.kernels))
        spec = SpeculativeConfig.from_value(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        for name, limit in zip(_BUCKETS, ("max_num_seqs", "max_num_batched_tokens")):
            if (b := getattr(self.kernels, name)) and b[-1] < getattr(self, limit):
                _fail(
                    "KernelConfig",
                    name,
                    b,
                    f"the largest must be >= {limit}={getattr(self, limit)}",
                )


_RULES = _rules()
