"""Frozen, validated configuration objects.

`ModelConfig` describes a model architecture (built from an HF ``config.json`` or GGUF metadata);
`EngineConfig` describes how the engine runs it (KV pool, buckets, attention back-end).
Both are frozen dataclasses validated at construction: a bad value raises ``ValueError`` naming the
field, the value and what is allowed. Never mutate one; use ``dataclasses.replace``.

This module imports no JAX, so the host side (scheduler, CLI argument checks) can use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _fail(cls: str, name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{cls}.{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (``rope_type: llama3`` in HF configs).

    Source: Llama 3.1 reference code, ``apply_scaling`` in meta-llama/llama-models; HF
    ``_compute_llama3_parameters``.
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3",):
            _fail("RopeScaling", "rope_type", self.rope_type, "only 'llama3' scaling is supported")
        if self.factor <= 0:
            _fail("RopeScaling", "factor", self.factor, "must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            _fail("RopeScaling", "high_freq_factor", self.high_freq_factor,
                  f"need 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor")
        if self.original_max_position_embeddings < 1:
            _fail("RopeScaling", "original_max_position_embeddings",
                  self.original_max_position_embeddings, "must be >= 1")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama / Qwen3 families.

    Shape letters (README.md): V=vocab_size, D=hidden_size, F=intermediate_size, L=num_layers,
    N=num_heads, K=num_kv_heads, H=head_dim, G=N/K.

    Raises:
        ValueError: an unsupported architecture or RoPE type, or inconsistent sizes.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            _fail("ModelConfig", "architecture", self.architecture,
                  f"supported architectures are {SUPPORTED_ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                _fail("ModelConfig", name, v, "must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            _fail("ModelConfig", "num_kv_heads", self.num_kv_heads,
                  f"must divide num_heads={self.num_heads} (GQA)")
        if self.head_dim % 2:
            _fail("ModelConfig", "head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        if self.rms_norm_eps <= 0:
            _fail("ModelConfig", "rms_norm_eps", self.rms_norm_eps, "must be > 0")
        if self.rope_theta <= 0:
            _fail("ModelConfig", "rope_theta", self.rope_theta, "must be > 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies a per-head RMSNorm to q and k before RoPE."""
        return self.architecture == "qwen3"

    @property
    def num_groups(self) -> int:
        """G = N / K, query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache bytes per token: 2 (K and V) x L x K x H x dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        Raises:
            ValueError: unsupported ``model_type``/architecture, RoPE type, attention/MLP bias, or
                a required key missing.
        """
        try:
            return cls._from_hf_config(cfg)
        except KeyError as e:
            raise ValueError(f"config.json lacks the required key {e.args[0]!r} "
                             f"(model_type={cfg.get('model_type')!r})") from None

    @classmethod
    def _from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        Raises:
            ValueError: unsupported ``model_type``/architecture, RoPE type, or attention/MLP bias.
        """
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} (architectures={archs}); "
                f"supported model_type values are {SUPPORTED_ARCHITECTURES}")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError(f"{model_type} with attention_bias/mlp_bias=True is not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{model_type} with use_sliding_window=True is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu'")

        # transformers 5 nests RoPE under rope_parameters; 4.x uses rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        if cfg.get("rope_scaling"):
            rope.update(cfg["rope_scaling"])
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))

        n = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // n
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=n,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json`` from an HF model directory.

        Raises:
            FileNotFoundError: no ``config.json`` in ``path``.
        """
        p = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no config.json in model directory {os.fspath(path)!r}")
        with open(p) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{p}: expected a JSON object")
        return cls.from_hf_config(cfg)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


ATTENTION_BACKENDS = ("auto", "reference", "triton", "mosaic", "jax_triton")
PREFILL_ATTENTION_BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    Fields:
        max_model_len: the most tokens (prompt + generated) one sequence may hold. ``None``: the
            model's ``max_position_embeddings``.
        page_size: tokens per KV page (block).
        num_pages: KV pool size in pages, including the reserved null page 0. ``None``: size the
            pool from ``memory_fraction`` of free device memory after the weights.
        memory_fraction: fraction of device memory the engine may use in total (weights + KV pool).
        max_num_seqs: the most sequences in one decode step (largest batch bucket).
        max_num_batched_tokens: the most prompt tokens in one prefill step (chunked prefill splits
            longer prompts).
        dtype: compute and KV dtype: "float32" or "bfloat16"; ``None``: bfloat16 on GPU, float32
            on CPU (XLA:CPU has no fast bf16 matmul).
        attention: paged-attention back-end name for decode steps; "auto" picks the fastest
            correct one for the device.
        prefill_attention: back-end for prefill steps (several query tokens per sequence):
            "reference" (gather + dense float32 softmax), "triton" (Pallas flash-attention
            kernel, GPU); "auto" is "triton" on GPU and the reference on CPU.
        batch_buckets / token_buckets: padded sizes for B and T; ``()`` = the defaults (B:
            powers of two up to 64, then every max(16, max_num_seqs // 16) rows; T: powers
            of two, see `jaxinfer.engine.batch_builder.BucketSpec`).
        compilation_cache_dir: a directory for JAX's persistent compilation cache, so a
            restarted engine loads its compiled steps instead of compiling them again
            (`jaxinfer.compile_cache.enable`: process-wide); ``None``: JAX's own setting.
        async_scheduling: schedule and dispatch step n+1 before reading back step n's tokens, so
            host work overlaps device work (vLLM's ``async_scheduling``); ``False``: each step is
            read back before the next is scheduled. Outputs are the same either way.
        cublas_decode_min_batch: decode steps whose batch bucket has at least this many rows are
            compiled with cuBLAS GEMMs (XLA's Triton GEMM emitter off for that step only;
            `jaxinfer.step.GEMM_COMPILER_OPTIONS`); every other step keeps XLA's choice. Default
            64: on the H200, cuBLAS decode steps were 2-4% faster at 64-256 rows and 32% slower
            at 1 row (BENCHMARKS.md). ``None``: XLA's choice for every step. GPU only in effect.
        qkv_prologue: each layer's q/k norm + RoPE + K/V page write, in decode and prefill
            steps: "xla" (the model's jnp ops, fused by XLA), "triton" (one Pallas kernel per
            layer, `pallas_kernels.qkv_prologue`; GPU only, H/2 a power of 2) or "auto"
            (default: "triton" on a GPU in bf16/f16 where the shapes allow, else "xla"). In
            packed prefill steps it replaces XLA's slow K/V scatter: on the H200 the throughput
            workload's 19 prefill steps took 3.68 s against 3.85 s with the kernel in decode
            steps only, 9,705 vs 9,589 tok/s, one run each side by side (BENCHMARKS.md, tenth
            session).
        add_rms_norm: every residual add + RMSNorm (two per layer, and the final norm): "xla"
            (jnp ops, fused by XLA), "triton" (one Pallas kernel each,
            `pallas_kernels.add_rms_norm`; GPU only, hidden size a power of 2) or "auto" (as
            above). On the H200 the two kernels together: 9,404 vs 9,305 tok/s on the
            throughput workload, B=1 decode 4.56 vs 4.61 ms (BENCHMARKS.md). Whenever the
            kernel is used ("triton", or "auto" where it resolves to it), decode steps (one
            token per row) of 128 rows or more also run the MLP's down projection as two
            float32 partial sums that the kernel adds (`jaxinfer.models.common.DOWN_PARTIALS`).
        prefill_gemm: GEMM back-end of prefill steps (packed prompt chunks): "xla" (XLA's choice:
            Triton GEMMs or cuBLAS per matmul) or "cublas" (XLA's Triton GEMM emitter off for
            those steps). GPU only in effect.
    """

    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    dtype: str | None = None
    attention: str = "auto"
    prefill_attention: str = "auto"
    seed: int = 0
    batch_buckets: tuple[int, ...] = ()
    token_buckets: tuple[int, ...] = ()
    async_scheduling: bool = True
    compilation_cache_dir: str | None = None
    cublas_decode_min_batch: int | None = 64
    prefill_gemm: str = "xla"
    qkv_prologue: str = "auto"
    add_rms_norm: str = "auto"

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                _fail("EngineConfig", name, v, "must be a positive integer")

        for name in ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
                     "cublas_decode_min_batch"):
            positive(name)
        if self.page_size & (self.page_size - 1):
            _fail("EngineConfig", "page_size", self.page_size, "must be a power of two (8, 16, 32, 64, ...)")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            _fail("EngineConfig", "num_pages", self.num_pages,
                  "must be an integer >= 2 (page 0 is the reserved null page)")
        if not 0.0 < self.memory_fraction <= 1.0:
            _fail("EngineConfig", "memory_fraction", self.memory_fraction, "must be in (0, 1]")
        if self.dtype not in (None, "float32", "bfloat16"):
            _fail("EngineConfig", "dtype", self.dtype, "allowed: None, 'float32', 'bfloat16'")
        if self.qkv_prologue not in ("auto", "xla", "triton"):
            _fail("EngineConfig", "qkv_prologue", self.qkv_prologue, "allowed: 'auto', 'xla', 'triton'")
        if self.add_rms_norm not in ("auto", "xla", "triton"):
            _fail("EngineConfig", "add_rms_norm", self.add_rms_norm, "allowed: 'auto', 'xla', 'triton'")
        if self.prefill_gemm not in ("xla", "cublas"):
            _fail("EngineConfig", "prefill_gemm", self.prefill_gemm, "allowed: 'xla', 'cublas'")
        if self.attention not in ATTENTION_BACKENDS:
            _fail("EngineConfig", "attention", self.attention, f"allowed: {ATTENTION_BACKENDS}")
        if self.prefill_attention not in PREFILL_ATTENTION_BACKENDS:
            _fail("EngineConfig", "prefill_attention", self.prefill_attention,
                  f"allowed: {PREFILL_ATTENTION_BACKENDS}")
        if self.compilation_cache_dir is not None and not isinstance(
                self.compilation_cache_dir, (str, os.PathLike)):
            _fail("EngineConfig", "compilation_cache_dir", self.compilation_cache_dir,
                  "must be None or a directory path")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            _fail("EngineConfig", "seed", self.seed, "must be an integer")
        if not isinstance(self.async_scheduling, bool):
            _fail("EngineConfig", "async_scheduling", self.async_scheduling, "must be True or False")
        for name in ("batch_buckets", "token_buckets"):
            b = getattr(self, name)
            if not isinstance(b, (tuple, list)):
                _fail("EngineConfig", name, b, "must be a tuple of strictly increasing positive "
                      "integers, or () for the defaults")
            b = tuple(b)
            if any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in b) or (
                    list(b) != sorted(set(b))):
                _fail("EngineConfig", name, b, "must be strictly increasing positive integers")
            object.__setattr__(self, name, b)
        if self.batch_buckets and self.batch_buckets[-1] < self.max_num_seqs:
            _fail("EngineConfig", "batch_buckets", self.batch_buckets,
                  f"the largest must be >= max_num_seqs={self.max_num_seqs}")
        if self.token_buckets and self.token_buckets[-1] < self.max_num_batched_tokens:
            _fail("EngineConfig", "token_buckets", self.token_buckets,
                  f"the largest must be >= max_num_batched_tokens={self.max_num_batched_tokens}")
