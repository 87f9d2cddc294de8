"""The Qwen3 mixture-of-experts MLP (HF ``Qwen3MoeSparseMoeBlock``) as pure functions: `route`
(softmax over all E router logits in f32, top-k, renormalised if ``norm_topk_prob``) and
`moe_mlp` (the token-expert pairs sorted by expert, one grouped GEMM per projection, gate|up
fused, SiLU-gated, weighted, unsorted and summed over k). Shape letters: T tokens, D, E experts,
k = top-k, F_e the experts' FFN width. The grouped GEMM is ``gemm``
(`models.kernels.GroupedGemm`: ``jax.lax.ragged_dot``, or the Pallas/Triton kernel
`pallas_kernels.moe_gemm`). Sources: HF ``modeling_qwen3_moe.py``; vLLM's ``fused_moe`` (sort
by expert, grouped GEMM, weighted sum)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.models.kernels import GroupedGemm
from jaxinfer.models.kv_cache import AXIS
from jaxinfer.models.layers import Weight

RAGGED_DOT = GroupedGemm()  # XLA's ragged_dot, the default grouped GEMM


def route(
    x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array]:
    """HF ``Qwen3MoeTopKRouter``: x [T, D] @ ``router`` [D, E] in x.dtype -> softmax over the E
    logits in f32 -> `jax.lax.top_k` -> divided by their sum if ``norm_topk_prob`` -> (weights
    [T, k] cast to x.dtype, experts i32[T, k]), in descending probability. Ties: the lower expert
    index first. HF's ``torch.topk`` on the CPU orders ties by libstdc++'s ``nth_element``, so
    where equal probabilities straddle the k-th place HF may keep another of them; elsewhere the
    chosen sets and weights are HF's (tests/models/test_moe.py)."""
    logits = x @ router.astype(x.dtype)  # [T, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def grouped_dense(
    xs: jax.Array, w, sizes: jax.Array, expert: jax.Array, gemm=RAGGED_DOT
) -> jax.Array:
    """Rows xs [M, in] sorted by expert, ``sizes`` i32[E] rows each, times their expert's matrix
    ``w`` (a `layers.Weight` of [E, in, out], or an array) by ``gemm`` (ragged_dot's contract) in
    xs.dtype; an fp8 weight (e4m3 with f32 scale [E, out]) is multiplied as it is (exact in bf16)
    with f32 accumulation and each row's expert's scale (``expert`` i32[M]) applied to the
    output; an HF FP8 checkpoint's (scale f32[E, in/bi, out/bo] of ``w.block``) goes to ``gemm``
    with its scales (`models.kernels.GroupedGemm`), f32 out. Expert stacks stay [E, in, out] in
    fp8 too, unlike the dense layers' per-channel matrices (K-major [out, in], `weights.kmajor`):
    ``GroupedGemm``'s contract is ragged_dot's, `pallas_kernels.moe_gemm` reads [in, out] tiles,
    and W8A8 (what K-major is for) does not apply to experts."""
    matrix, scale = (w.w, w.scale) if isinstance(w, Weight) else (w, None)
    if scale is None:
        return gemm(xs, matrix, sizes)  # converted to xs.dtype by the GEMM
    if w.block is not None:
        f32 = jnp.float32
        return gemm(xs, matrix, sizes, f32, scale=scale, block=w.block).astype(xs.dtype)
    y = gemm(xs, matrix, sizes, preferred_element_type=jnp.float32)
    return (y * jnp.take(scale, expert, axis=0)).astype(xs.dtype)


def _experts(
    xs: jax.Array, w_gate_up, w_down, sizes: jax.Array, expert: jax.Array, gemm
) -> jax.Array:
    """The SwiGLU of each sorted row xs [M, D] through its expert: [M, D] (`grouped_dense`;
    ``w_gate_up``'s columns [gate | up] of F_e each, or of this device's F_e / tp)."""
    gu = grouped_dense(xs, w_gate_up, sizes, expert, gemm)  # [M, 2 F_e]
    Fe = gu.shape[-1] // 2
    h = jax.nn.silu(gu[:, :Fe]) * gu[:, Fe:]
    return grouped_dense(h, w_down, sizes, expert, gemm)


def _sharded(mesh, w_gate_up, w_down, gemm):
    """`_experts` under ``jax.shard_map`` over ``mesh``'s "tp" axis: each device its share of
    every expert's F_e (gate_up's columns [gate_s | up_s], `engine_layout`; down's rows), the
    rows and routing whole on each, the partial outputs summed (psum)."""

    def spec(w, axis):  # a Weight's matrix split on ``axis``, its scales as `weights.entries`
        matrix = P(*(None,) * axis, AXIS)
        if not isinstance(w, Weight):
            return matrix
        per_channel = P(None, AXIS) if axis == 2 else P()  # [E, out]: split with the columns
        scale = None if w.scale is None else matrix if w.block else per_channel
        return Weight(matrix, scale, w.block, w.w8a8)

    def local(xs, gate_up, down, sizes, expert):
        return jax.lax.psum(_experts(xs, gate_up, down, sizes, expert, gemm), AXIS)

    return jax.shard_map(
        local,
        mesh=mesh,
        check_vma=False,
        in_specs=(P(), spec(w_gate_up, 2), spec(w_down, 1), P(), P()),
        out_specs=P(),
    )


def moe_mlp(
    x: jax.Array,
    router: jax.Array,
    w_gate_up,
    w_down,
    *,
    top_k: int,
    norm_topk_prob: bool,
    mesh=None,
    gemm=RAGGED_DOT,
) -> jax.Array:
    """x [..., D] -> [..., D]: each token's `route`'d k experts, ``sum_k weight_k *
    (silu(x @ gate_e) * (x @ up_e)) @ down_e`` with ``w_gate_up`` [E, D, 2 F_e] ([gate | up] per
    expert) and ``w_down`` [E, F_e, D] (arrays or `layers.Weight`s, fp8 too: `grouped_dense`).
    The T*k token-expert pairs are sorted by expert (stable), so each expert's rows are one
    contiguous group of ``bincount`` rows for ``jax.lax.ragged_dot``; the products go back to
    their pair's place and are summed over k. ``mesh``: tensor parallelism over each expert's
    F_e (`_sharded`), or None; ``gemm``: the grouped GEMM (`models.kernels.GroupedGemm`)."""
    shape, D = x.shape, x.shape[-1]
    x2 = x.reshape(-1, D)
    T, E = x2.shape[0], router.shape[-1]
    with jax.named_scope("moe_route"):
        weights, experts = route(x2, router, top_k, norm_topk_prob)
        flat = experts.reshape(-1)  # [T*k]: pair p is token p // k's choice p % k
        order = jnp.argsort(flat, stable=True)  # pairs by expert
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # i32[E] group sizes
        xs = jnp.take(x2, order // top_k, axis=0)  # [T*k, D]
        expert = jnp.take(flat, order)  # i32[T*k]: each sorted row's expert
    with jax.named_scope("moe_mlp"):
        if mesh is None:
            y = _experts(xs, w_gate_up, w_down, sizes, expert, gemm)  # [T*k, D]
        else:
            y = _sharded(mesh, w_gate_up, w_down, gemm)(xs, w_gate_up, w_down, sizes, expert)
        y = y * jnp.take(weights.reshape(-1), order)[:, None]
        y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back in pair order
        return y.reshape(T, top_k, D).sum(axis=1).reshape(shape).astype(x.dtype)
