"""fp8 W8A8's per-token activation quantisation (issue 46) in isolation: GPU time of the ops that
produce a Qwen3-8B GEMM's e4m3 input at M tokens, as XLA runs them in the engine today against
the fused Pallas kernels (`pallas_kernels.act_quant`), from a JAX profiler trace.

Ops (``--ops``):
  norm   the residual add + RMSNorm over D, then the per-token quantisation (before q|k|v and
         gate|up): ``(x + delta, e4m3, scale)`` from x, delta [M, D] bf16
  silu   the SwiGLU ``silu(gate) * up`` of gate_up [M, 2F] bf16, then the quantisation (before
         down): ``(e4m3, scale)``

Variants (``--variants``):
  xla              the engine's jnp code, jitted: `layers.add_rms_norm` or the SwiGLU product of
                   `layers.mlp`, then `quantize.quantize_tokens` (``--kernels fp8_gemm=w8a8``)
  fused[-mB][-wW]  `act_quant.add_rms_norm_quant` / `silu_mul_quant` (at most B rows a
                   program, W warps; default 1 and 8)
  <variant>+gemm   the same followed by the e4m3 GEMM that reads it (`quantize.w8a8_gemm`,
                   the weight e4m3 [out, in]: q|k|v 6144 x D after norm, D x F after silu), so
                   the difference end to end shows

Each timed call runs ``--layers`` independent instances (distinct inputs and weights, so they
come from HBM, not L2); the time of one is the sum of its GPU kernels' durations. Prints µs, the
ratio to the xla variant (xla+gemm for +gemm) at the same op and M, and, for the fused variants,
the fraction of e4m3 values apart from xla's (XLA may skip the roundings to bf16 between ops that
the kernels do); appends JSON lines (bench="act_quant") to ``--out``.

    python scripts/probes/bench_act_quant.py [--tokens 1 16 64 256 2048] [--ops norm silu]
        [--variants xla fused fused-w4 xla+gemm fused+gemm]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer.models.layers import add_rms_norm  # noqa: E402
from jaxinfer.models.quantize import quantize_fp8, quantize_tokens, w8a8_gemm  # noqa: E402
from pallas_kernels.act_quant import add_rms_norm_quant, silu_mul_quant  # noqa: E402
from scripts.profile_decode_step import (  # noqa: E402
    add_trace_options,
    kernel_us_per_call,
    require_gpu,
)
from scripts.run_info import device_row  # noqa: E402

D, F, QKV, EPS = 4096, 12288, 6144, 1e-6  # Qwen3-8B: model width, FFN width, q|k|v columns
GEMM_IN_OUT = {"norm": (D, QKV), "silu": (F, D)}  # the GEMM each op's output feeds
OPS = tuple(GEMM_IN_OUT)
_VARIANT = re.compile(r"(xla|fused(?:-m(\d+))?(?:-w(\d+))?)(\+gemm)?")


def variant_name(v: str) -> str:
    """``v`` if it names a variant, else argparse's error."""
    if _VARIANT.fullmatch(v):
        return v
    raise argparse.ArgumentTypeError(f"unknown variant {v!r}: xla, fused[-mB][-wW], with +gemm")


def xla_norm_quant(x, delta, w):
    """The engine's path before q|k|v and gate|up: (x + delta, e4m3, scale)."""
    total, h = add_rms_norm(x, delta, w, eps=EPS)
    return (total, *quantize_tokens(h))


def xla_silu_quant(gate_up):
    """The engine's path before down (`layers.mlp`, shards 1): (e4m3, scale)."""
    return quantize_tokens(jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:])


def producer(op: str, variant: str):
    """The op's quantising producer for one variant: ``(inputs) -> (..., e4m3, scale)``."""
    m = _VARIANT.fullmatch(variant)
    knobs = {k: int(g) for k, g in zip(("block_m", "num_warps"), m.group(2, 3)) if g}
    if m.group(1) == "xla":
        return xla_norm_quant if op == "norm" else xla_silu_quant
    if op == "norm":
        return functools.partial(add_rms_norm_quant, eps=EPS, **knobs)
    return functools.partial(silu_mul_quant, **knobs)


def step_fn(op: str, variant: str):
    """(jitted fn over lists of each instance's inputs and weights) for one op and variant."""
    produce, gemm = producer(op, variant), variant.endswith("+gemm")

    def one(inputs, weight):
        *rest, x8, sx = produce(*inputs)
        y = w8a8_gemm(x8, sx, *weight).astype(jnp.bfloat16) if gemm else None  # as `dense`
        return (*rest, y) if gemm else (*rest, x8, sx)

    return jax.jit(lambda ins, ws: [one(i, w) for i, w in zip(ins, ws)])


def instances(op: str, M: int, layers: int) -> tuple[list, list]:
    """``layers`` random instances: inputs (norm: x, delta [M, D], w [D]; silu: gate_up [M, 2F],
    bf16) and the e4m3 GEMM weight [out, in] with its f32 scale."""
    keys = iter(jax.random.split(jax.random.key(M), 4 * layers))
    normal = lambda shape, s=1.0: jax.random.normal(next(keys), shape, jnp.bfloat16) * s  # noqa: E731
    if op == "norm":
        ins = [(normal((M, D)), normal((M, D)), 1 + normal((D,), 0.1)) for _ in range(layers)]
    else:
        ins = [(normal((M, 2 * F), 2.0),) for _ in range(layers)]
    n_in, n_out = GEMM_IN_OUT[op]
    return ins, [quantize_fp8(normal((n_in, n_out), 0.02)) for _ in range(layers)]


def codes_apart(op: str, variant: str, ins: list) -> float:
    """Fraction of the e4m3 values of ``variant`` apart from the xla variant's, first instance."""
    got, want = (jax.jit(producer(op, v))(*ins[0])[-2] for v in (variant, "xla"))
    return float(jnp.mean(got.view(jnp.uint8) != want.view(jnp.uint8)))


def measure(op: str, variant: str, M: int, layers: int, reps: int) -> dict:
    """Kernel µs per instance, the kernels that ran and (fused) the values apart from xla's."""
    ins, ws = instances(op, M, layers)
    per = kernel_us_per_call(step_fn(op, variant), (ins, ws), layers, reps)
    row = dict(
        us=sum(per.values()),
        kernels={k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
    )
    if variant.startswith("fused"):
        row["codes_apart"] = codes_apart(op, variant.removesuffix("+gemm"), ins)
    return row


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048], help="M")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["xla", "fused", "xla+gemm", "fused+gemm"],
        type=variant_name,
        help="xla, fused[-mB][-wW], each optionally +gemm (see the module docstring)",
    )
    add_trace_options(ap, 4, "independent instances per timed call")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    require_gpu(ap)
    meta = device_row("act_quant")
    print(f"{'op':<5} {'M':>5} {'variant':<18} {'us':>8} {'ratio':>6} {'apart':>6}  kernels")
    for op in args.ops:
        for M in args.tokens:
            rows = {}
            for v in args.variants:
                try:
                    rows[v] = measure(op, v, M, args.layers, args.reps)
                except Exception as e:  # one failing variant does not end the sweep
                    print(f"{op:<5} {M:>5} {v:<18} failed: {type(e).__name__}: {e}"[:200])
            for v, r in rows.items():
                base = rows.get("xla+gemm" if v.endswith("+gemm") else "xla")
                r["ratio_to_xla"] = round(r["us"] / base["us"], 3) if base else None
                print(
                    f"{op:<5} {M:>5} {v:<18} {r['us']:>8.2f} {r['ratio_to_xla'] or '':>6} "
                    f"{r.get('codes_apart', ''):>6.4}  "
                    + ", ".join(f"{k[:40]} {t}" for k, t in list(r["kernels"].items())[:3]),
                    flush=True,
                )
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(dict(meta, op=op, M=M, D=D, F=F, variant=v, **r)) + "\n")


if __name__ == "__main__":
    main()
