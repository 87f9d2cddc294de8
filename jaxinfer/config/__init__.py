"""Frozen, validated configuration: `ModelConfig` (`jaxinfer.config.model`), `EngineConfig` (user
settings, vLLM meanings; `jaxinfer.config.engine`), `KernelConfig` (`jaxinfer.config.kernels`);
`SpeculativeConfig` (`jaxinfer.config.speculative`); `engine_config` (`LLM`'s vLLM arguments;
`jaxinfer.config.vllm_args`); `resolve` makes "auto" concrete (`ResolvedConfig`;
`jaxinfer.config.resolved`). A bad value raises ValueError naming the
field, the value and what is allowed. No JAX."""

from jaxinfer.config.engine import KV_CACHE_DTYPES, EngineConfig
from jaxinfer.config.kernels import KERNEL_ALIASES, KernelConfig, check_platform, kernel_choices
from jaxinfer.config.model import ModelConfig, check_tp
from jaxinfer.config.resolved import DTYPE_BYTES, FP8_KV_DECODE, ResolvedConfig, resolve
from jaxinfer.config.speculative import SpeculativeConfig
from jaxinfer.config.vllm_args import VLLM_ALIASES, VLLM_NO_EFFECT, VLLM_ONLY, engine_config

__all__ = [
    "DTYPE_BYTES",
    "FP8_KV_DECODE",
    "KERNEL_ALIASES",
    "KV_CACHE_DTYPES",
    "VLLM_ALIASES",
    "VLLM_NO_EFFECT",
    "VLLM_ONLY",
    "EngineConfig",
    "KernelConfig",
    "ModelConfig",
    "ResolvedConfig",
    "SpeculativeConfig",
    "check_platform",
    "check_tp",
    "engine_config",
    "kernel_choices",
    "resolve",
]
