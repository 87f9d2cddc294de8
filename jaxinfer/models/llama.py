"""Llama (2/3/3.x, SmolLM2, ...), Qwen3 (the Llama trunk plus a per-head RMSNorm of q and k,
``cfg.qk_norm``) and Qwen3-MoE (Qwen3 with `moe.moe_mlp` on its sparse layers) over the paged KV
cache; the modules declare `config.weights`' tree (`MODEL` in `LlamaForCausalLM`, a layer's
`layer_leaves` per `DecoderLayer`; ``lm_head`` for init only). The L layers are unrolled, each a
call of one jitted `decoder_layer` with its index as an argument (traced once per weight
structure: dense layers and MoE layers). Sources: HF ``modeling_llama.py``, ``modeling_qwen3.py``,
``modeling_qwen3_moe.py``; the Llama 2, Llama 3 and Qwen3 reports."""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.config.weights import LAYER, MODEL
from jaxinfer.models.kernels import ActQuant, ModelKernels
from jaxinfer.models.kv_cache import AXIS, KV_HEAD_SPEC, KV_POOL_SPEC, KVCache
from jaxinfer.models.layers import (
    Ragged,
    StepContext,
    Weight,
    add_rms_norm,
    attend,
    declare,
    dense,
    mlp,
    rms_norm,
    rope,
    rope_cos_sin,
    rope_inv_freq,
    write_kv,
)
from jaxinfer.models.lora import LoRAStep, add_lora, at_layer
from jaxinfer.models.moe import moe_mlp
from pallas_kernels import act_quant


def attention_heads(
    qkv: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    ctx: StepContext,
    wq: jax.Array | None,
    wk: jax.Array | None,
    *,
    kernels: ModelKernels,
    layer: jax.Array,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Everything between the qkv and output GEMMs on N = ``num_heads`` query and K =
    ``num_kv_heads`` KV heads (one device's under tensor parallelism): qkv [B, T, (N+2K)*H]
    (`fused_parts`) -> per-head RMSNorm of q and k (``wq``, ``wk`` [H], or None), RoPE, K/V written
    into pools [L, P, K, page_size, H] at ``layer`` (i32[]) -> ``kernels.attention`` on q
    [B, T, N, H]. Returns (o [B, T, N, H], k_pool, v_pool)."""
    B, T, _ = qkv.shape
    N, K, H = num_heads, num_kv_heads, k_pool.shape[-1]
    with jax.named_scope("qkv_prologue"):
        qk = qkv[..., : (N + K) * H].reshape(B, T, N + K, H)
        v = qkv[..., (N + K) * H :].reshape(B * T, K, H)
        if wq is not None:  # one RMSNorm over the N + K heads, the weights broadcast
            qk = rms_norm(
                qk,
                jnp.concatenate([jnp.broadcast_to(wq, (N, H)), jnp.broadcast_to(wk, (K, H))]),
                eps,
            )
        with jax.named_scope("rope"):
            qk = rope(qk, ctx.cos, ctx.sin)
        with jax.named_scope("kv_write"):
            k_pool, v_pool = write_kv(
                k_pool,
                v_pool,
                layer,
                qk[:, :, N:].reshape(B * T, K, H),
                v,
                ctx.slot_mapping.reshape(-1),
                ctx.k_scale,
                ctx.v_scale,
                ctx.k_mean,
                ctx.v_mean,
            )  # scales, means
    with jax.named_scope("attention"):
        o = attend(kernels, qk[:, :, :N], k_pool, v_pool, ctx, layer=layer, scale=H**-0.5)
    if ctx.v_mean is not None:  # pages hold v - v_mean; the probabilities sum to 1
        o = o + jnp.repeat(ctx.v_mean[layer], N // K, axis=0).astype(o.dtype)
    return o, k_pool, v_pool


def attention(
    x: jax.Array,
    w: dict,
    layer: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    ctx: StepContext,
    *,
    cfg,
    kernels: ModelKernels,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] (or `layers.Quantized` for a W8A8 wqkv: B, T and the output dtype read from
    it) @ ``w["wqkv"]`` -> `attention_heads` (RMSNorm weights ``w["q_norm"]``,
    ``w["k_norm"]`` [H], or None) -> @ ``w["wo"]``. With ``kernels.mesh``, `attention_heads` runs
    under ``jax.shard_map`` on each device's heads (wqkv's columns shard-major, `engine_layout`;
    the pools and ``ctx``'s KV scales and means split over K', the rest of ``ctx`` whole) and
    XLA sums the row-split ``wo`` GEMM. Returns (out [B, T, D], k_pool, v_pool)."""
    B, T, _ = x.shape
    N, K, H, tp = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kernels.tp
    with jax.named_scope("qkv"):
        qkv = add_lora(dense(x, w["wqkv"]), x, "wqkv", lora=ctx.lora)  # [B, T, (N+2K)H]
    heads = functools.partial(
        attention_heads,
        kernels=kernels,
        layer=layer,
        num_heads=N // tp,
        num_kv_heads=K // tp,
        eps=cfg.rms_norm_eps,
    )
    if tp > 1:
        pool, kv_heads = KV_POOL_SPEC, ("k_scale", "v_scale", "k_mean", "v_mean")
        ctx_spec = jax.tree.map(lambda _: P(), ctx)._replace(
            **{f: KV_HEAD_SPEC for f in kv_heads if getattr(ctx, f) is not None}
        )
        heads = jax.shard_map(
            heads,
            mesh=kernels.mesh,
            check_vma=False,
            in_specs=(P(None, None, AXIS), pool, pool, ctx_spec, P(), P()),
            out_specs=(P(None, None, AXIS, None), pool, pool),
        )
    o, k_pool, v_pool = heads(qkv, k_pool, v_pool, ctx, w["q_norm"], w["k_norm"])
    with jax.named_scope("attention"):
        o = o.astype(x.dtype).reshape(B, T, N * H)
        out = add_lora(dense(o, w["wo"]), o, "wo", lora=ctx.lora)
        out = out.astype(x.dtype)
    return out, k_pool, v_pool


class _Module(nn.Module):
    """Fields of every block here: ``cfg``, ``kernels``, the params' dtype, ``quantization``."""

    cfg: Any
    kernels: ModelKernels
    param_dtype: Any = jnp.float32
    quantization: str | None = None


def fused_quant(w: Weight | None, kernels: ModelKernels, ctx: StepContext) -> ActQuant | None:
    """The one decision of whether the op producing the input of ``w`` (a layer's matrix, or
    None) writes it quantised per token, through the returned `ActQuant`: ``fp8_act_quant``
    "fused", ``w`` W8A8 with an input width the kernels take (`act_quant.supported`), one device
    (tensor parallelism splits the SwiGLU's F), no LoRA (adapters read the unquantised input)
    and no calibration probe. None: the unfused op (`layers.dense` quantises a W8A8 GEMM's
    input)."""
    aq = kernels.fp8_act_quant
    on = aq.variant == "fused" and kernels.tp == 1 and ctx.lora is None and kernels.observe is None
    w8a8 = isinstance(w, Weight) and w.w8a8 and act_quant.supported(w.w.shape[-1])  # [out, in]
    return aq if on and w8a8 else None


def decoder_layer(
    w: dict,
    x: jax.Array,
    pending: jax.Array | None,
    layer: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    ctx: StepContext,
    *,
    cfg,
    kernels: ModelKernels,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pre-norm layer ``layer`` (i32[]) with weights ``w`` (`LAYER`'s, None where the layer has no
    such leaf), ``x += attn(attn_norm(x)); x += mlp(mlp_norm(x))``, each residual add done with the
    next norm (`add_rms_norm`): ``(x [B, T, D], pending, ...) -> (x, pending, k_pool, v_pool)``;
    ``pending``: the MLP output not yet added (None into layer 0). The MLP: `moe_mlp` where ``w``
    has a router (an MoE layer), else the dense SwiGLU `mlp`. Where `fused_quant` says so, the
    norms and the SwiGLU product quantise the next GEMM's input themselves."""
    eps = cfg.rms_norm_eps
    qkv, gate_up, down = (
        fused_quant(w.get(n), kernels, ctx) for n in ("wqkv", "w_gate_up", "w_down")
    )
    x, h = (qkv.add_rms_norm if qkv else add_rms_norm)(x, pending, w["attn_norm"], eps=eps)
    a, k_pool, v_pool = attention(h, w, layer, k_pool, v_pool, ctx, cfg=cfg, kernels=kernels)
    x, h = (gate_up.add_rms_norm if gate_up else add_rms_norm)(x, a, w["mlp_norm"], eps=eps)
    if w.get("router") is None:
        adapt = ctx.lora and functools.partial(add_lora, lora=ctx.lora)
        silu = down and down.silu_mul
        return x, mlp(h, w["w_gate_up"], w["w_down"], kernels.tp, adapt, silu), k_pool, v_pool
    moe = functools.partial(
        moe_mlp,
        top_k=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        mesh=kernels.mesh,
        gemm=kernels.moe_gemm,
    )
    return x, moe(h, w["router"], w["w_experts_gate_up"], w["w_experts_down"]), k_pool, v_pool


# one trace per step shape for all L layers (the layer index is an argument): the step's tracing
# time does not grow with L; XLA inlines the call, so the compiled step is the unrolled one
_decoder_layer = jax.jit(decoder_layer, static_argnames=("cfg", "kernels"))


class DecoderLayer(_Module):
    """`decoder_layer` over this module's weights: ``(x, pending, layer: int, k_pool, v_pool,
    ctx) -> (x, pending, k_pool, v_pool)``; ``ctx.lora`` (all layers') narrowed to the layer's."""

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        pending: jax.Array | None,
        layer: int,
        k_pool: jax.Array,
        v_pool: jax.Array,
        ctx: StepContext,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        w = {name: declare(self, name, layer) for name in LAYER}  # the weight table's
        return _decoder_layer(
            w,
            x,
            pending,
            jnp.asarray(layer, jnp.int32),
            k_pool,
            v_pool,
            ctx._replace(lora=at_layer(ctx.lora, layer)),  # this layer's LoRA arrays
            cfg=self.cfg,
            kernels=self.kernels,
        )


class Layers(_Module):
    """The L `DecoderLayer` children "0".."L-1", unrolled: ``(x [B, T, D], k_pool, v_pool, ctx)
    -> (x, pending, k_pool, v_pool)`` (see `DecoderLayer`; the final norm adds ``pending``)."""

    @nn.compact
    def __call__(
        self, x: jax.Array, k_pool: jax.Array, v_pool: jax.Array, ctx: StepContext
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        pending = None
        for i in range(self.cfg.num_layers):
            layer = DecoderLayer(
                self.cfg, self.kernels, self.param_dtype, self.quantization, name=str(i)
            )
            x, pending, k_pool, v_pool = layer(x, pending, i, k_pool, v_pool, ctx)
        return x, pending, k_pool, v_pool


class LlamaForCausalLM(_Module):
    """Trunk: embed -> `Layers` -> final norm: ``(tokens, positions, slot_mapping i32[B, T], kv,
    ragged, lora: `models.lora.LoRAStep` or None) -> (hidden [B, T, D] in the params' dtype, kv
    with the pools written)``."""

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        slot_mapping: jax.Array,
        kv: KVCache,
        ragged: Ragged | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[jax.Array, KVCache]:
        cfg, w = self.cfg, {name: declare(self, name) for name in MODEL}
        x = jnp.take(w["embed"], tokens, axis=0)  # [B, T, D], compute dtype
        with jax.named_scope("rope"):
            cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg))
        ctx = StepContext(
            positions.astype(jnp.int32),
            slot_mapping.astype(jnp.int32),
            kv.block_tables,
            kv.seq_lens,
            cos,
            sin,
            ragged,
            *kv.scales(),
            lora=lora,
        )
        layers = Layers(cfg, self.kernels, self.param_dtype, self.quantization, name="layers")
        x, pending, k_pool, v_pool = layers(x, kv.k, kv.v, ctx)
        _, x = add_rms_norm(x, pending, w["final_norm"], eps=cfg.rms_norm_eps)
        return x, kv.replace(k=k_pool, v=v_pool)
