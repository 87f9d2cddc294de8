"""`resolve`: the one place "auto" becomes concrete (`ResolvedConfig`: dtypes, kernels,
max_model_len and quantization for a model on a platform). No JAX."""

from __future__ import annotations

import dataclasses
import logging

from jaxinfer.config.engine import KV_CACHE_DTYPES, EngineConfig
from jaxinfer.config.kernels import KERNEL_ALIASES, KernelConfig, check_platform
from jaxinfer.config.model import ModelConfig, _fail, check_tp
from pallas_kernels.paged_attention import registry

DEFAULT_SMOOTHQUANT = 0.4  # alpha where W8A8 runs (docs/fp8.md: SmolLM2, 0.4 beat 0.5)
RAGGED_DECODE_MAX_TOKENS_GPU = 32  # BENCHMARKS "Issue 45": verify steps 1.37x against 1.56x
DEFAULT_SPEC_DECODE_ROWS = 16  # disable_by_batch_size when unset (BENCHMARKS: verify steps)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}
FP8_KV_DECODE = ("reference", "triton")  # decode variants validated on fp8 pages


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
    spec_decode_rows: int = 0  # speculation while decode rows <= this (0: off); `spec_rows`
    smoothquant: float | None = None  # SmoothQuant's alpha (`_smoothquant`); None: off

    spec_rows = property(
        lambda self: self.spec_decode_rows + 1 if self.spec_decode_rows else 0,
        doc="Most rows of a verify step: its decode rows and one prefill row.",
    )

    dtype_bytes = property(lambda self: DTYPE_BYTES[self.dtype])
    kv_dtype_bytes = property(lambda self: DTYPE_BYTES[self.kv_dtype])


def resolve(
    model: ModelConfig, engine: EngineConfig, platform: str, device_kind: str | None = None
) -> ResolvedConfig:
    """Every "auto"/None of ``engine`` for ``model`` on ``platform`` (JAX backend) made concrete. On
    "gpu": bfloat16, prefill triton, in half precision decode mosaic (fp8 KV: triton); else float32
    and reference; a variant not validated on ``device_kind`` falls back (`registry.for_device`,
    logged). max_model_len None: max_position_embeddings; quantization None: "fp8" for an FP8
    checkpoint; fp8 GEMMs stay on XLA (cuBLAS cannot fuse the e4m3 convert). ValueError:
    max_model_len above that, a GPU kernel off "gpu", float16 on "gpu", fp8 KV with a decode
    variant not in `FP8_KV_DECODE`, a tp the model cannot take (`check_tp`), LoRA
    with tp > 1 or an MoE model (`_check_lora`), a SmoothQuant alpha where it cannot apply
    (`_smoothquant`); smoothquant None: `DEFAULT_SMOOTHQUANT` with W8A8; fp8_act_quant "fused"
    where it cannot apply: "xla" (`_act_quant`, logged)."""
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
    kv_dtype = KV_CACHE_DTYPES[engine.kv_cache_dtype] or dtype
    fp8 = kv_dtype != dtype
    _check_fp8_kv(engine, kc, fp8)
    check_tp(model, engine.tensor_parallel_size)
    _check_lora(model, engine)
    gpu, half = platform == "gpu", dtype in ("bfloat16", "float16")
    kc = _kernels(kc, gpu and half, gpu, fp8, quant, device_kind)
    kc = dataclasses.replace(kc, fp8_act_quant=_act_quant(model, engine, kc, quant))
    return ResolvedConfig(
        model,
        engine,
        kc,
        max_len,
        dtype,
        platform,
        kv_dtype,
        quant,
        _spec_decode_rows(engine, max_len),
        _smoothquant(model, engine, kc, quant),
    )


def _kernels(kc: KernelConfig, half_gpu: bool, gpu: bool, fp8_kv: bool, quant, device_kind):
    """``kc`` with its "auto" attention variants chosen (GPU in half precision: decode mosaic,
    triton with fp8 KV; GPU: prefill triton; else the references), each falling back to one
    validated on ``device_kind`` (logged); fp8 weights (``quant``) keep every GEMM on XLA;
    ``fp8_gemm="w8a8"`` without fp8 weights does nothing, and says so (logged); None
    ``ragged_decode_max_tokens``: `RAGGED_DECODE_MAX_TOKENS_GPU` with a decode kernel, 0 with
    the reference; ``moe_gemm`` "auto": "mixed" on a GPU, else "ragged_dot"."""
    if kc.fp8_gemm == "w8a8" and quant is None:
        logging.getLogger("jaxinfer").warning(
            "jaxinfer: fp8_gemm='w8a8' applies to fp8 weights only and is ignored here: "
            "pass quantization='fp8' (--quantization fp8) to run W8A8"
        )
    auto = {
        "decode_attention": ("triton" if fp8_kv else "mosaic") if half_gpu else "reference",
        "prefill_attention": "triton" if gpu else "reference",
    }
    moe = kc.moe_gemm if kc.moe_gemm != "auto" else ("mixed" if gpu else "ragged_dot")
    for k in (k for k in KERNEL_ALIASES.values() if getattr(kc, k) == "auto"):  # explicit: kept
        if (new := registry.for_device(auto[k], device_kind)) != auto[k]:
            logging.getLogger("jaxinfer").warning(
                "jaxinfer: %s=%r is not validated on %r; using %r", k, auto[k], device_kind, new
            )
            auto[k] = new
    decode = auto["decode_attention"] if kc.decode_attention == "auto" else kc.decode_attention
    by_token = kc.ragged_decode_max_tokens
    if by_token is None:
        by_token = 0 if decode == "reference" else RAGGED_DECODE_MAX_TOKENS_GPU
    return dataclasses.replace(
        kc,
        **{k: v for k, v in auto.items() if getattr(kc, k) == "auto"},
        ragged_decode_max_tokens=by_token,
        moe_gemm=moe,
        **({"cublas_decode_min_batch": None} if quant else {}),
    )


def _act_quant(model: ModelConfig, engine: EngineConfig, kc: KernelConfig, quant) -> str:
    """``kc.fp8_act_quant``, or "xla" where "fused" cannot apply, with one warning saying why:
    it quantises the inputs of W8A8 GEMMs (``fp8_gemm="w8a8"``, fp8 weights with per-channel
    scales) on one device (tensor parallelism splits the SwiGLU's F over devices) without LoRA
    (whose adapters read the unquantised activations)."""
    why = (
        "it needs W8A8: fp8_gemm='w8a8' with quantization='fp8' (--quantization fp8)"
        if kc.fp8_gemm != "w8a8" or quant != "fp8"
        else "an FP8 checkpoint's block-scaled weights keep the W8A16 GEMM"
        if model.weight_block_size
        else f"it runs on one device, not tensor_parallel_size={engine.tensor_parallel_size}"
        if engine.tensor_parallel_size > 1
        else "LoRA adapters read the unquantised activations (enable_lora)"
        if engine.enable_lora
        else None
    )
    if kc.fp8_act_quant != "fused" or why is None:
        return kc.fp8_act_quant
    logging.getLogger("jaxinfer").warning(
        "jaxinfer: fp8_act_quant='fused' is ignored here (XLA quantises): %s", why
    )
    return "xla"


def _check_fp8_kv(engine: EngineConfig, kc: KernelConfig, fp8: bool) -> None:
    """ValueError for what an fp8 KV cache cannot yet run with: a decode variant not in
    `FP8_KV_DECODE`."""
    if fp8 and kc.decode_attention not in ("auto", *FP8_KV_DECODE):
        raise ValueError(
            f"KernelConfig.decode_attention={kc.decode_attention!r} is not validated "
            f"with fp8 KV (kv_cache_dtype={engine.kv_cache_dtype!r}); use one of "
            f"{('auto', *FP8_KV_DECODE)}"
        )


def _smoothquant(model: ModelConfig, engine: EngineConfig, kc: KernelConfig, quant):
    """SmoothQuant's alpha (`jaxinfer.models.smoothquant`) or None: ``engine.smoothquant`` where
    it applies (fp8 weights with per-channel scales; one device; no LoRA, whose adapters would
    read the smoothed inputs), None giving `DEFAULT_SMOOTHQUANT` with ``fp8_gemm="w8a8"`` and
    off with W8A16; 0 off. ValueError: an alpha above 0 where it does not apply."""
    alpha = engine.smoothquant
    why = (
        "it needs fp8 weights: quantization='fp8'"
        if quant != "fp8"
        else "an FP8 checkpoint's weights are quantised already"
        if model.weight_block_size
        else "it runs on one device only"
        if engine.tensor_parallel_size > 1
        else "LoRA adapters would read the smoothed activations"
        if engine.enable_lora
        else None
    )
    if alpha == 0 or alpha is None and (why or kc.fp8_gemm != "w8a8"):
        return None
    if why:
        _fail("EngineConfig", "smoothquant", alpha, f"{why}; use None or 0")
    return DEFAULT_SMOOTHQUANT if alpha is None else float(alpha)


def _check_lora(model: ModelConfig, engine: EngineConfig) -> None:
    """ValueError for what LoRA (``enable_lora``) cannot yet run with: tensor_parallel_size > 1,
    a mixture-of-experts model."""
    if not engine.enable_lora:
        return
    if (tp := engine.tensor_parallel_size) > 1:
        _fail("EngineConfig", "tensor_parallel_size", tp, "enable_lora runs on one device; use 1")
    if model.num_experts:
        _fail(
            "EngineConfig",
            "enable_lora",
            True,
            f"LoRA is not yet for mixture-of-experts models ({model.architecture})",
        )


def _spec_decode_rows(engine: EngineConfig, max_len: int) -> int:
    """Decode rows that still speculate: ``disable_by_batch_size`` or the default; 0: off.
    ValueError: k + 1 tokens a row above ``max_num_batched_tokens`` or ``max_model_len``."""
    spec = engine.speculative_config
    if spec is None:
        return 0
    if (k := spec.num_speculative_tokens) + 1 > (
        most := min(engine.max_num_batched_tokens, max_len)
    ):
        _fail(
            "SpeculativeConfig",
            "num_speculative_tokens",
            k,
            f"a verified row takes k + 1 tokens, at most min(max_num_batched_tokens, "
            f"max_model_len) = {most}",
        )
    return spec.disable_by_batch_size or DEFAULT_SPEC_DECODE_ROWS
