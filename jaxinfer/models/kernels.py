"""`ModelKernels`, the static kernel argument of `jaxinfer.models.forward`, built by `model_kernels`
from a resolved `KernelConfig`; its attention has `reference.paged_attention`'s signature."""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.models.layers import Quantized
from jaxinfer.models.quantize import expand_scale
from pallas_kernels import act_quant, moe_gemm
from pallas_kernels.paged_attention import ragged, reference, registry


@functools.partial(jax.jit, static_argnames=("kernel", "scale", "block_q"))
def ragged_step(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    query_start_loc,
    layer,
    scales,
    *,
    kernel,
    scale,
    block_q,
):
    """q [T, N, H], layer i32[], scales as `decode_step` -> [T, N, H] (`ragged`'s tiles)."""
    return ragged.ragged_paged_attention(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        query_start_loc,
        layer=layer,
        scale=scale,
        attention=kernel,
        block_q=block_q,
        **scales,
    )


@dataclass(frozen=True)
class RaggedAttention:
    """Ragged rows through `ragged.ragged_paged_attention`'s tiles of ``block_q`` tokens, each
    tile attended by prefill variant ``prefill``, jitted with ``layer`` as i32[]. ``block_q``
    None: 16 for a kernel (its 64-row MMA tile at G = 4), 128 for the jnp reference (each tile
    gathers its row's whole K/V: fewer, larger tiles move less on a CPU)."""

    prefill: str = "reference"
    block_q: int | None = None

    def __call__(
        self,
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        query_start_loc,
        *,
        layer,
        scale,
        k_scale=None,
        v_scale=None,
    ):
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        return ragged_step(
            q,
            k_pool,
            v_pool,
            block_tables,
            seq_lens,
            query_start_loc,
            jnp.asarray(layer, jnp.int32),
            scales,
            kernel=registry.get_prefill(self.prefill),
            scale=float(scale),
            block_q=self.block_q or (128 if self.prefill == "reference" else 16),
        )


# "mixed": the Pallas kernel up to this many routed rows (top-k x tokens), where it reads only the
# chosen experts; above it each expert's weights are read once per 16-row tile, so ragged_dot
# takes over.
MIXED_TRITON_MAX_ROWS = 512


@dataclass(frozen=True)
class GroupedGemm:
    """The grouped GEMM of mixture-of-experts layers, ``jax.lax.ragged_dot``'s contract: (xs [M,
    I], w [E, I, O] (xs's dtype or e4m3), sizes i32[E], preferred_element_type) -> [M, O]; with
    ``scale`` f32[E, ceil(I/bi), ceil(O/bo)] of an HF FP8 checkpoint's blocks ``block`` (bo, bi):
    the product with w's values times their block's scale. variant "ragged_dot" (XLA's; block
    scales: the stack dequantised, traced, as `layers.Weight.value`), "triton"
    (`pallas_kernels.moe_gemm.grouped_gemm`, scaling each K block's partial product, for stacks
    it has tiles for (`moe_gemm.supported`), else ragged_dot) or "mixed" (triton for M <=
    `MIXED_TRITON_MAX_ROWS`, else ragged_dot); ``interpret``: the Pallas interpreter (CPU
    tests)."""

    variant: str = "ragged_dot"
    interpret: bool = False

    def __call__(self, xs, w, sizes, preferred_element_type=None, *, scale=None, block=None):
        small = xs.shape[0] <= MIXED_TRITON_MAX_ROWS
        triton = self.variant == "triton" or (self.variant == "mixed" and small)
        if triton and moe_gemm.supported(w.shape, block):
            return moe_gemm.grouped_gemm(
                xs,
                w,
                sizes,
                scale=scale,
                block=block,
                preferred_element_type=preferred_element_type,
                interpret=self.interpret,
            )
        if block is not None:
            w = w.astype(jnp.float32) * expand_scale(scale, w.shape, block)
        w = w.astype(xs.dtype)  # e4m3 is exact in xs's dtype
        return jax.lax.ragged_dot(xs, w, sizes, preferred_element_type=preferred_element_type)


@dataclass(frozen=True)
class ActQuant:
    """Where a W8A8 GEMM's input is quantised per token: variant "xla" (`layers.dense`: XLA's ops
    between the producing op and the GEMM) or "fused" (the producing op writes e4m3:
    `pallas_kernels.act_quant` through `add_rms_norm` and `silu_mul`; the layers that take them:
    `llama.fused_quant`); ``interpret``: the Pallas interpreter (CPU tests)."""

    variant: str = "xla"
    interpret: bool = False

    def add_rms_norm(self, x, delta, w, *, eps: float) -> tuple[jax.Array, Quantized]:
        """`layers.add_rms_norm` with the normalised value quantised per token: x, delta
        [B, T, D] (delta None: no add), w [D] -> (x + delta in x.dtype, `Quantized` [B, T, D])."""
        total, q, scale = act_quant.add_rms_norm_quant(
            x, delta, w, eps=eps, interpret=self.interpret
        )
        return total, Quantized(q, scale, x.dtype)

    def silu_mul(self, gate_up: jax.Array) -> Quantized:
        """`layers.mlp`'s SwiGLU product (one column group) quantised per token: gate_up
        [B, T, 2F] ([gate | up]) -> `Quantized` [B, T, F] in gate_up's dtype."""
        q, scale = act_quant.silu_mul_quant(gate_up, interpret=self.interpret)
        return Quantized(q, scale, gate_up.dtype)


@dataclass(frozen=True)
class ModelKernels:
    """attention: B rows of T tokens (`reference.paged_attention`'s contract); ragged: ragged rows
    (`reference.ragged_paged_attention`'s); mesh: None, or the 1-D "tp" mesh of tensor
    parallelism (`runner.parallel.make_mesh`); verify steps of at most ``ragged_decode_max_tokens``
    tokens attend token by token through ``attention``'s decode rows (`layers.by_token`); fp8_gemm:
    fp8 weights' GEMM, "w8a16" (bf16 activations) or "w8a8" (`layers.dense`); observe: None, or
    (calibration) a `smoothquant.ActivationMax` whose probes see each unquantised GEMM's input;
    moe_gemm: the experts' grouped GEMM (`GroupedGemm`); fp8_act_quant: where W8A8 GEMMs' inputs
    are quantised (`ActQuant`)."""

    attention: Callable = reference.paged_attention
    mesh: Any = None
    ragged: Callable = RaggedAttention()
    ragged_decode_max_tokens: int = 0
    fp8_gemm: str = "w8a16"
    observe: Any = None
    moe_gemm: Callable = GroupedGemm()
    fp8_act_quant: ActQuant = ActQuant()

    tp = property(
        lambda self: 1 if self.mesh is None else self.mesh.size,
        doc="Devices the model is sharded over (1: no mesh).",
    )


@functools.partial(jax.jit, static_argnames=("kernel", "knobs", "scale"))
def decode_step(
    q, k_pool, v_pool, block_tables, seq_lens, layer, page_offset, scales, *, kernel, knobs, scale
):
    """q [B, 1, N, H], layer i32[], page_offset: mosaic's or None, scales: {} or fp8's -> q's."""
    extra = dict(knobs, **scales, **({} if page_offset is None else {"page_offset": page_offset}))
    out = kernel(q[:, 0], k_pool, v_pool, block_tables, seq_lens, layer=layer, scale=scale, **extra)
    return out[:, None]


@functools.partial(jax.jit, static_argnames=("kernel", "scale"))
def prefill_step(
    q, k_pool, v_pool, block_tables, seq_lens, q_positions, layer, scales, *, kernel, scale
):
    """q [B, T, N, H], layer i32[], scales as `decode_step` -> [B, T, N, H]."""
    return kernel(
        q, k_pool, v_pool, block_tables, seq_lens, q_positions, layer=layer, scale=scale, **scales
    )


@dataclass(frozen=True)
class PagedAttention:
    """T == 1 to decode variant ``decode`` (``decode_knobs``), T > 1 to prefill variant ``prefill``,
    jitted with ``layer`` as i32[]."""

    decode: str = "reference"
    prefill: str = "reference"
    decode_knobs: tuple[tuple[str, Any], ...] = ()

    def __call__(
        self,
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        q_positions,
        *,
        layer,
        scale,
        k_scale=None,
        v_scale=None,
    ):
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        scale = float(scale)
        if q.shape[1] == 1 and self.decode != "reference":
            offset = None
            if self.decode == "mosaic":
                from pallas_kernels.paged_attention.mosaic import layer_offsets

                offset = layer_offsets(layer, k_pool.shape[1])
            return decode_step(
                q,
                k_pool,
                v_pool,
                block_tables,
                seq_lens,
                jnp.asarray(layer, jnp.int32),
                offset,
                scales,
                kernel=registry.get(self.decode),
                knobs=self.decode_knobs,
                scale=scale,
            )
        if q.shape[1] == 1 or self.prefill == "reference":
            return reference.paged_attention(
                q,
                k_pool,
                v_pool,
                block_tables,
                seq_lens,
                q_positions,
                layer=layer,
                scale=scale,
                **scales,
            )
        return prefill_step(
            q,
            k_pool,
            v_pool,
            block_tables,
            seq_lens,
            q_positions,
            jnp.asarray(layer, jnp.int32),
            scales,
            kernel=registry.get_prefill(self.prefill),
            scale=scale,
        )


def model_kernels(kc, decode_knobs: dict | None = None, mesh=None) -> ModelKernels:
    """`ModelKernels` for a resolved `KernelConfig`; ``decode_knobs``: decode-variant keywords.
    ValueError: an unregistered variant, reference knobs."""
    decode, prefill = kc.decode_attention, kc.prefill_attention
    registry.get(decode), registry.get_prefill(prefill)  # raise ValueError listing the names
    if decode_knobs and decode == "reference":
        raise ValueError(
            f"decode_knobs={decode_knobs} need a decode kernel variant; the reference has no knobs"
        )
    attention = reference.paged_attention
    if (decode, prefill) != ("reference", "reference"):
        attention = PagedAttention(decode, prefill, tuple(sorted((decode_knobs or {}).items())))
    by_token = kc.ragged_decode_max_tokens or 0  # None, unresolved: off (`resolve` sets it)
    return ModelKernels(
        attention,
        mesh,
        RaggedAttention(prefill),
        by_token,
        kc.fp8_gemm,
        moe_gemm=GroupedGemm(kc.moe_gemm),
        fp8_act_quant=ActQuant(kc.fp8_act_quant),
    )
