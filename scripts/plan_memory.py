"""Print the KV-cache memory plan of a model on a device.

Capacity planning; the engine sizes its pool with `jaxinfer.config.memory.engine_pool_pages`.

    python scripts/plan_memory.py --model qwen3-8b --context 4096 --device-memory-gib 141
    python scripts/plan_memory.py --model /path/to/hf_dir_or.gguf --context 8192 --kv-dtype fp8

``--model``: a preset (``PRESETS``) or a checkpoint `ModelConfig.from_checkpoint` reads (a
GGUF file's metadata only). Without ``--device-memory-gib``: JAX's ``bytes_limit`` of the local
accelerator. A plan: usable = device_bytes x utilization, used = weight_bytes + reserve_bytes
(per device under tensor parallelism) + with ``--enable-lora`` the LoRA pool's bytes (the
engine's `jaxinfer.lora.peft.pool_bytes`); num_pages = `jaxinfer.config.memory.kv_pool_pages`;
max_concurrent = (num_pages - 1) // ceil(context / page_size), planned = floor(PLANNING_FRACTION
x that). Bad input: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.cli_args import Parser, fail  # noqa: E402
from jaxinfer.config import DTYPE_BYTES, EngineConfig, ModelConfig  # noqa: E402
from jaxinfer.config.memory import (
    _gib,
    default_reserve_bytes,  # noqa: E402
    kv_bytes_per_token,
    kv_pool_pages,
)
from jaxinfer.config.weights import device_bytes  # noqa: E402
from scripts.plan_memory_checks import (
    check_plan_args,
    gib_to_bytes,
    kv_budget,
    lora_pool_bytes,
    max_sequences,
)

MIB = 1 << 20
PLANNING_FRACTION = 0.7  # plan at this fraction of the theoretical concurrent sequences

PRESETS: dict[str, ModelConfig] = {  # published config.json of Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B,
    # SmolLM2-135M-Instruct (V, D, F, L, N, K, H: `ModelConfig` field order)
    "qwen3-8b": ModelConfig(
        "qwen3",
        151936,
        4096,
        12288,
        36,
        32,
        8,
        128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    "qwen3-30b-a3b": ModelConfig(
        "qwen3_moe",
        151936,
        2048,
        6144,
        48,
        32,
        4,
        128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_ids=(151645,),
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "smollm2-135m": ModelConfig(
        "llama",
        49152,
        576,
        1536,
        30,
        9,
        3,
        64,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def param_count(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the model one device of ``tp`` holds (`weights.device_bytes`)."""
    return device_bytes(cfg, tp)


def device_memory_stats(device=None) -> tuple[int, int] | None:
    """``(bytes_in_use, bytes_limit)`` (the XLA allocator's limit) of ``device`` (default
    ``jax.devices()[0]``), or None where the backend reports none (the CPU)."""
    if device is None:
        import jax

        device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without the API raise (NotImplementedError, RuntimeError)
        return None
    keys = ("bytes_in_use", "bytes_limit")
    return tuple(int(stats[k]) for k in keys) if all(k in stats for k in keys) else None


def fp8_weight_bytes(cfg: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes one device of ``tp`` holds of the tree with fp8 weights (`jaxinfer.models.quantize`):
    the layers' matrices at 1 byte plus their f32 scales; embedding, lm_head and norms at
    ``dtype_bytes`` (the compute dtype). `jaxinfer.config.weights.device_bytes`."""
    return device_bytes(cfg, tp, dtype_bytes, "fp8")


@dataclass(frozen=True)
class MemoryPlan:
    """A KV capacity plan (module doc). Bytes of one device (of ``tensor_parallel_size``);
    ``num_pages`` includes the null page; ``lora``: (max_loras, max_lora_rank) of the LoRA pool
    of ``lora_pool_bytes``, None: LoRA off (0 bytes)."""

    kv_bytes_per_token: int
    weight_bytes: int
    device_bytes: int
    utilization: float
    reserve_bytes: int
    kv_pool_bytes: int
    page_size: int
    num_pages: int
    context: int
    max_concurrent_seqs: int
    planned_concurrent_seqs: int
    planning_fraction: float = PLANNING_FRACTION
    tensor_parallel_size: int = 1
    lora: tuple[int, int] | None = None
    lora_pool_bytes: int = 0

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_bytes_per_token

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    def table(self) -> str:
        """A two-column text table of the plan."""

        def b(n: int) -> str:
            return f"{_gib(n)}  ({n:,} B)"

        usable, kvt = int(self.device_bytes * self.utilization), self.kv_bytes_per_token
        tp, used = self.tensor_parallel_size, self.weight_bytes + self.reserve_bytes
        S, R = self.lora or (0, 0)
        lora = [("LoRA pool", f"{S} slot(s) x rank {R} = {b(self.lora_pool_bytes)}")]
        rows = [
            ("tensor parallel", f"{tp} device(s); the bytes below are per device"),
            ("device memory", b(self.device_bytes)),
            ("utilization", f"{self.utilization:g}  -> usable {_gib(usable)}"),
            ("weights", b(self.weight_bytes)),
            ("reserve (activations, workspace)", b(self.reserve_bytes)),
            *(lora if self.lora else []),
            ("KV budget", b(usable - used - self.lora_pool_bytes)),
            ("KV bytes per token", f"{kvt:,} B  ({kvt / 1024:,.1f} KiB)"),
            ("page size", f"{self.page_size} tokens  ({self.page_bytes / MIB:,.3f} MiB per page)"),
            (
                "KV pool",
                f"{self.num_pages:,} pages incl. null page 0 = {_gib(self.kv_pool_bytes)}"
                f"  ({self.kv_pool_bytes:,} B, {(self.num_pages - 1) * self.page_size:,} "
                "tokens)",
            ),
            (
                "context",
                f"{self.context:,} tokens = {self.pages_per_seq:,} pages"
                f" = {self.pages_per_seq * self.page_bytes / MIB:,.1f} MiB per sequence",
            ),
            ("max concurrent sequences", f"{self.max_concurrent_seqs:,}"),
            (f"planned ({self.planning_fraction:.0%})", f"{self.planned_concurrent_seqs:,}"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def plan_memory(
    cfg: ModelConfig,
    *,
    device_bytes: int,
    utilization: float = 0.9,
    context: int,
    page_size: int = 16,
    weight_dtype_bytes: int = 2,
    kv_dtype_bytes: int = 2,
    reserve_bytes: int | None = None,
    weight_bytes: int | None = None,
    planning_fraction: float = PLANNING_FRACTION,
    tensor_parallel_size: int = 1,
    lora: tuple[int, int] | None = None,
    compute_dtype_bytes: int | None = None,
) -> MemoryPlan:
    """The KV plan of ``cfg`` on ``tensor_parallel_size`` devices of ``device_bytes`` each
    (module doc; bytes per device). ``context``: tokens per sequence; ``*_dtype_bytes``: bytes
    per element; None ``reserve_bytes``: `default_reserve_bytes`, ``weight_bytes``: ``param_count
    x weight_dtype_bytes``; ``lora``: (max_loras, max_lora_rank) with enable_lora, its pool
    (`lora_pool_bytes`, ``compute_dtype_bytes`` or else ``weight_dtype_bytes`` an element) off the
    KV budget. Raises ValueError: an argument out of range, a model tp cannot split (`check_tp`),
    a LoRA pool the engine refuses, weights (+ LoRA pool) or a ``context`` that do not fit."""
    ints = dict(device_bytes=device_bytes, page_size=page_size, context=context)
    ints |= dict(weight_dtype_bytes=weight_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes)
    ints["tensor_parallel_size"] = tp = tensor_parallel_size  # checked in this order
    check_plan_args(cfg, ints, utilization, planning_fraction)
    reserve_bytes = default_reserve_bytes(device_bytes) if reserve_bytes is None else reserve_bytes
    if weight_bytes is None:
        weight_bytes = param_count(cfg, tp) * weight_dtype_bytes
    lora_bytes = lora_pool_bytes(cfg, lora, tp, compute_dtype_bytes or weight_dtype_bytes)
    usable, budget = kv_budget(device_bytes, utilization, weight_bytes, reserve_bytes, lora_bytes)
    kv_per_token = kv_bytes_per_token(cfg, kv_dtype_bytes, tp)
    page_bytes = page_size * kv_per_token
    num_pages = kv_pool_pages(
        cfg,
        page_size=page_size,
        dtype_bytes=kv_dtype_bytes,
        usable_bytes=usable,
        used_bytes=weight_bytes + reserve_bytes + lora_bytes,
        tp=tp,
    )
    max_seqs = max_sequences(context, page_size, page_bytes, num_pages, budget)
    return MemoryPlan(
        kv_per_token,
        weight_bytes,
        device_bytes,
        float(utilization),
        reserve_bytes,
        num_pages * page_bytes,
        page_size,
        num_pages,
        context,
        max_seqs,
        math.floor(planning_fraction * max_seqs),
        float(planning_fraction),
        tp,
        lora,
        lora_bytes,
    )


def local_device_bytes() -> tuple[int, str] | None:
    """(bytes_limit, description) of JAX's device 0 if it is an accelerator, else None."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # others may use the GPU
    import jax

    dev = jax.devices()[0]
    stats = None if dev.platform == "cpu" else device_memory_stats(dev)
    return stats and (stats[1], f"JAX bytes_limit of {dev.platform}:{dev.id} ({dev.device_kind})")


def _parser() -> argparse.ArgumentParser:
    p = Parser("python scripts/plan_memory.py", __doc__.split("\n")[0])
    p.add_argument(
        "--model",
        required=True,
        help=f"HF model dir, GGUF file, or preset ({', '.join(sorted(PRESETS))})",
    )
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="device memory in GiB (default: the local accelerator's; required when JAX sees none)",
    )
    p.add_argument(
        "--utilization",
        type=float,
        default=0.9,
        help="fraction of device memory the engine may use",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--kv-dtype", "--kv-cache-dtype", choices=sorted(DTYPE_BYTES), default="bfloat16"
    )
    p.add_argument(
        "--weight-dtype",
        choices=sorted(DTYPE_BYTES),
        default="bfloat16",
        help="fp8: the engine's quantization='fp8' (embedding, lm_head, norms in "
        "bfloat16, f32 scales)",
    )
    p.add_argument(
        "--weight-gib",
        type=float,
        default=None,
        help="resident weight size in GiB "
        "(per device), overriding the count from the config (quantised checkpoints)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices the model is sharded over; the plan is per device",
    )
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=None,
        help="activations/workspace reserve in GiB (default max(1, 5%% of device))",
    )
    _add_lora_options(p)
    return p


def _add_lora_options(p: argparse.ArgumentParser) -> None:
    """vLLM's ``--enable-lora``, ``--max-loras`` and ``--max-lora-rank`` (`EngineConfig`'s
    defaults) on ``p``."""
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="plan the LoRA adapter pool (vLLM's --enable-lora), taken from the KV budget",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=EngineConfig.max_loras,
        help="with --enable-lora: LoRA adapters on the device at once (slots)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=EngineConfig.max_lora_rank,
        help="with --enable-lora: largest LoRA rank (every slot padded to it)",
    )


def _weight_bytes(args, cfg: ModelConfig) -> int | None:
    """``--weight-gib``, or for ``--weight-dtype fp8`` `fp8_weight_bytes`; None: counted."""
    given = gib_to_bytes("--weight-gib", args.weight_gib)
    if given is not None or args.weight_dtype != "fp8":
        return given
    return fp8_weight_bytes(cfg, 2, args.tensor_parallel_size)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 2 bad input)."""
    try:
        args = _parser().parse_args(argv)
        if args.model not in PRESETS and not os.path.exists(args.model):
            raise ValueError(
                f"--model={args.model!r} is invalid: not a directory, a file or a "
                f"preset; allowed presets: {sorted(PRESETS)}"
            )
        cfg = PRESETS.get(args.model) or ModelConfig.from_checkpoint(args.model)
        device = gib_to_bytes("--device-memory-gib", args.device_memory_gib, False)
        device = (device, "--device-memory-gib") if device else local_device_bytes()
        if device is None:
            raise ValueError("--device-memory-gib is required: JAX sees no GPU on this machine")
        plan = plan_memory(
            cfg,
            device_bytes=device[0],
            utilization=args.utilization,
            context=args.context,
            page_size=args.page_size,
            weight_dtype_bytes=DTYPE_BYTES[args.weight_dtype],
            kv_dtype_bytes=DTYPE_BYTES[args.kv_dtype],
            reserve_bytes=gib_to_bytes("--reserve-gib", args.reserve_gib),
            weight_bytes=_weight_bytes(args, cfg),
            tensor_parallel_size=args.tensor_parallel_size,
            lora=(args.max_loras, args.max_lora_rank) if args.enable_lora else None,
            compute_dtype_bytes=2 if args.weight_dtype == "fp8" else None,
        )
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(
        f"model    {args.model}: {cfg.architecture} L={cfg.num_layers} D={cfg.hidden_size} "
        f"F={cfg.intermediate_size} N={cfg.num_heads} K={cfg.num_kv_heads} H={cfg.head_dim} "
        f"V={cfg.vocab_size} tied={cfg.tie_word_embeddings}"
    )
    print(
        f"dtypes   weights {args.weight_dtype if args.weight_gib is None else '(given)'}, "
        f"KV {args.kv_dtype}; device memory from {device[1]}"
    )
    print(plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
