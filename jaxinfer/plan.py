"""``python -m jaxinfer.plan``: print the KV-cache memory plan of a model on a device.

    python -m jaxinfer.plan --model qwen3-8b --context 4096 --device-memory-gib 141
    python -m jaxinfer.plan --model /path/to/hf_dir_or.gguf --context 8192 --kv-dtype fp8

``--model``: a preset (``PRESETS``) or a checkpoint `ModelConfig.from_checkpoint` reads (a
GGUF file's metadata only). Without ``--device-memory-gib``: JAX's ``bytes_limit`` of the local
accelerator. Formulas: `jaxinfer.memory`. Bad input: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from jaxinfer.cli_args import Parser, fail
from jaxinfer.config import DTYPE_BYTES, ModelConfig
from jaxinfer.memory import GIB, device_memory_stats, fp8_weight_bytes, plan_memory

PRESETS: dict[str, ModelConfig] = {  # published config.json of Qwen/Qwen3-8B, SmolLM2-135M-Instruct
    # (V, D, F, L, N, K, H: `ModelConfig` field order)
    "qwen3-8b": ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, rms_norm_eps=1e-6,
                            rope_theta=1e6, max_position_embeddings=40960,
                            bos_token_id=151643, eos_token_ids=(151645,)),
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, rms_norm_eps=1e-5,
                                rope_theta=1e5, max_position_embeddings=8192,
                                tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
}


def local_device_bytes() -> tuple[int, str] | None:
    """(bytes_limit, description) of JAX's device 0 if it is an accelerator, else None."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # others may use the GPU
    import jax

    dev = jax.devices()[0]
    stats = None if dev.platform == "cpu" else device_memory_stats(dev)
    return stats and (stats[1], f"JAX bytes_limit of {dev.platform}:{dev.id} ({dev.device_kind})")


def _parser() -> argparse.ArgumentParser:
    p = Parser("python -m jaxinfer.plan", __doc__.split("\n")[0])
    p.add_argument("--model", required=True,
                   help=f"HF model dir, GGUF file, or preset ({', '.join(sorted(PRESETS))})")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument("--device-memory-gib", type=float, default=None, help="device memory in GiB "
                   "(default: the local accelerator's; required when JAX sees none)")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="fraction of device memory the engine may use")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", choices=sorted(DTYPE_BYTES),
                   default="bfloat16")
    p.add_argument("--weight-dtype", choices=sorted(DTYPE_BYTES), default="bfloat16",
                   help="fp8: the engine's quantization='fp8' (embedding, lm_head, norms in "
                   "bfloat16, f32 scales; one device)")
    p.add_argument("--weight-gib", type=float, default=None, help="resident weight size in GiB "
                   "(per device), overriding the count from the config (quantised checkpoints)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model is sharded over; the plan is per device")
    p.add_argument("--reserve-gib", type=float, default=None,
                   help="activations/workspace reserve in GiB (default max(1, 5%% of device))")
    return p


def _gib_to_bytes(flag: str, value: float | None, allow_zero: bool = True) -> int | None:
    if value is not None and (not (value > 0 or allow_zero and value == 0) or value == float("inf")):
        raise ValueError(f"{flag}={value!r} is invalid: must be finite and "
                         f"{'>= 0' if allow_zero else '> 0'}")
    return None if value is None else int(round(value * GIB))


def _weight_bytes(args, cfg: ModelConfig) -> int | None:
    """``--weight-gib``, or for ``--weight-dtype fp8`` `fp8_weight_bytes`; None: counted."""
    given = _gib_to_bytes("--weight-gib", args.weight_gib)
    if given is not None or args.weight_dtype != "fp8":
        return given
    if args.tensor_parallel_size > 1:
        raise ValueError(f"--weight-dtype fp8 with --tensor-parallel-size "
                         f"{args.tensor_parallel_size}: fp8 weights run on one device only (1)")
    return fp8_weight_bytes(cfg, 2)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 2 bad input)."""
    try:
        args = _parser().parse_args(argv)
        if args.model not in PRESETS and not os.path.exists(args.model):
            raise ValueError(f"--model={args.model!r} is invalid: not a directory, a file or a "
                             f"preset; allowed presets: {sorted(PRESETS)}")
        cfg = PRESETS.get(args.model) or ModelConfig.from_checkpoint(args.model)
        device = _gib_to_bytes("--device-memory-gib", args.device_memory_gib, False)
        device = (device, "--device-memory-gib") if device else local_device_bytes()
        if device is None:
            raise ValueError("--device-memory-gib is required: JAX sees no GPU on this machine")
        plan = plan_memory(
            cfg, device_bytes=device[0], utilization=args.utilization, context=args.context,
            page_size=args.page_size, weight_dtype_bytes=DTYPE_BYTES[args.weight_dtype],
            kv_dtype_bytes=DTYPE_BYTES[args.kv_dtype],
            reserve_bytes=_gib_to_bytes("--reserve-gib", args.reserve_gib),
            weight_bytes=_weight_bytes(args, cfg),
            tensor_parallel_size=args.tensor_parallel_size)
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(f"model    {args.model}: {cfg.architecture} L={cfg.num_layers} D={cfg.hidden_size} "
          f"F={cfg.intermediate_size} N={cfg.num_heads} K={cfg.num_kv_heads} H={cfg.head_dim} "
          f"V={cfg.vocab_size} tied={cfg.tie_word_embeddings}")
    print(f"dtypes   weights {args.weight_dtype if args.weight_gib is None else '(given)'}, "
          f"KV {args.kv_dtype}; device memory from {device[1]}")
    print(plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
