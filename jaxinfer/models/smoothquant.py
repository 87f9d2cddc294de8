"""SmoothQuant for W8A8 (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", arXiv 2211.10438, eq. 4): per input channel j of a
projection W [in, out], ``s_j = max|x_j|^a / max_k |W_jk|^(1 - a)``; ``W' = diag(s) W`` and
``x' = x / s`` folded offline into the op that produces x, so the served model is the same
function before quantisation and each W8A8 projection stays one e4m3 x e4m3 GEMM with per-token
and per-channel scales. Producers (`fold`): the RMSNorm weight before q|k|v (``attn_norm``) and
before gate|up (``mlp_norm``), the up columns before down (``h = silu(gate) * up``), the v columns
before o (per KV head and channel: query head n reads KV head n // (N / K)). max|x_j|: one
calibration pass over held-out text (`activation_max`); sparse (MoE) layers' experts keep their
input (W8A8 does not apply to them)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.config.weights import fused_parts, layer_leaves
from jaxinfer.models.kernels import ModelKernels
from jaxinfer.models.kv_cache import init_kv_cache
from jaxinfer.models.quantize import is_quantized, quantize_params

SMOOTHED = ("wqkv", "wo", "w_gate_up", "w_down")  # the projections whose inputs are smoothed


@dataclasses.dataclass(eq=False)
class ActivationMax:
    """Calibration sink (`ModelKernels.observe`): per matrix name, the f32[in] max |x| over the
    tokens of each `layers.dense` call on it, in program order (ordered callbacks)."""

    records: dict = dataclasses.field(default_factory=dict)

    def probe(self, name: str) -> "Probe":
        """The `layers.Weight.observe` of matrix ``name``."""
        return Probe(self, name)

    def add(self, name: str, amax) -> None:
        self.records.setdefault(name, []).append(np.asarray(amax, np.float32))

    def per_layer(self, cfg) -> dict[str, dict[int, np.ndarray]]:
        """name -> layer -> f32[in]: call i of ``name`` is the (i mod n)-th of the n layers of
        ``cfg`` that have it (`layer_leaves`); repeated passes: the maximum."""
        out = {}
        for name, recs in self.records.items():
            layers = [i for i in range(cfg.num_layers) if name in layer_leaves(cfg, i)]
            got = out.setdefault(name, {})
            for k, a in enumerate(recs):
                i = layers[k % len(layers)]
                got[i] = a if i not in got else np.maximum(got[i], a)
        return out


@dataclasses.dataclass(frozen=True)
class Probe:
    """Hands max |x| over all but the last axis of each input x [..., in] of matrix ``name`` to
    ``sink`` (hashable: a static part of the `layers.Weight` it rides in)."""

    sink: ActivationMax
    name: str

    def __call__(self, x: jax.Array) -> None:
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0)
        jax.debug.callback(functools.partial(self.sink.add, self.name), amax, ordered=True)


def activation_max(params: dict, cfg, ids: np.ndarray) -> dict[str, dict[int, np.ndarray]]:
    """`ActivationMax.per_layer` of one forward of ``ids`` i32[T] (one sequence from position 0,
    one KV page of T tokens, float32 cache) over unquantised ``params``."""
    sink, T = ActivationMax(), len(ids)
    kv = init_kv_cache(cfg, 2, T, jnp.float32)  # page 1 holds the whole sequence
    kv = kv.replace(block_tables=jnp.ones((1, 1), jnp.int32), seq_lens=jnp.full((1,), T, jnp.int32))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    fwd = jax.jit(models.forward, static_argnames=("cfg", "kernels"))
    tokens = jnp.asarray(ids, jnp.int32)[None]
    jax.block_until_ready(
        fwd(params, cfg, tokens, pos, pos + T, kv, kernels=ModelKernels(observe=sink))
    )
    jax.effects_barrier()
    return sink.per_layer(cfg)


def smoothing_factors(params: dict, cfg, amax: dict, alpha: float) -> dict[str, dict]:
    """Layer key -> matrix name -> f32 s: ``amax^alpha / wmax^(1 - alpha)`` (1 where either is
    0), wmax the max |W| over each input row; [in] for "wqkv", "w_gate_up", "w_down", [K, H] for
    "wo" (the maxima over each KV head's G = N / K query heads, so s folds into v's columns)."""
    K, H = cfg.num_kv_heads, cfg.head_dim

    def s_of(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ok = (x > 0) & (w > 0)
        x, w = np.where(ok, x, 1.0), np.where(ok, w, 1.0)
        return np.where(ok, x**alpha / w ** (1.0 - alpha), 1.0).astype(np.float32)

    out = {}
    for key, layer in params["layers"].items():
        wmax = {
            n: np.asarray(jnp.max(jnp.abs(jnp.asarray(layer[n], jnp.float32)), axis=-1))
            for n in SMOOTHED
            if n in amax and int(key) in amax[n]
        }
        x = {n: amax[n][int(key)] for n in wmax}
        if "wo" in x:  # [N*H] -> [K, G, H] -> [K, H]
            x["wo"], wmax["wo"] = (a.reshape(K, -1, H).max(1) for a in (x["wo"], wmax["wo"]))
        out[key] = {n: s_of(x[n], wmax[n]) for n in x}
    return out


def _scaled(a, s, rows: bool, cols: slice | None = None, divide: bool = False):
    """``a`` [in, out] with its rows (``rows``) or the columns ``cols`` times s (or over s), in
    float32, cast back to a's dtype; a 1-D ``a``: elementwise."""
    af, s = jnp.asarray(a, jnp.float32), jnp.asarray(s, jnp.float32)
    s = 1.0 / s if divide else s
    if a.ndim == 1:
        return (af * s).astype(a.dtype)
    if rows:
        return (af * s[:, None]).astype(a.dtype)
    return af.at[:, cols].multiply(s).astype(a.dtype)


def fold(params: dict, cfg, factors: dict) -> dict:
    """A new tree (unquantised) computing the same function with `smoothing_factors` ``factors``
    folded in: "wqkv": attn_norm / s, wqkv rows x s; "w_gate_up": mlp_norm / s, its rows x s;
    "w_down": the up columns / s, w_down rows x s; "wo" [K, H]: the v columns / s, wo rows x s of
    each query head's KV head. Other leaves shared."""
    parts, G = fused_parts(cfg), cfg.num_heads // cfg.num_kv_heads
    layers = {}
    for key, layer in params["layers"].items():
        w, f = dict(layer), factors.get(key, {})
        if "wqkv" in f:
            w["attn_norm"] = _scaled(w["attn_norm"], f["wqkv"], True, divide=True)
            w["wqkv"] = _scaled(w["wqkv"], f["wqkv"], True)
        if "w_gate_up" in f:
            w["mlp_norm"] = _scaled(w["mlp_norm"], f["w_gate_up"], True, divide=True)
            w["w_gate_up"] = _scaled(w["w_gate_up"], f["w_gate_up"], True)
        if "w_down" in f:
            up = parts["w_gate_up"]["up"]
            w["w_gate_up"] = _scaled(w["w_gate_up"], f["w_down"], False, up, divide=True)
            w["w_down"] = _scaled(w["w_down"], f["w_down"], True)
        if "wo" in f:
            v = parts["wqkv"]["v"]
            w["wqkv"] = _scaled(w["wqkv"], f["wo"].reshape(-1), False, v, divide=True)
            w["wo"] = _scaled(w["wo"], np.repeat(f["wo"], G, axis=0).reshape(-1), True)
        layers[key] = w
    return {**params, "layers": layers}


def smooth_params(params: dict, cfg, ids: np.ndarray, alpha: float) -> tuple[dict, dict]:
    """(`fold` of ``params`` by the `smoothing_factors` of their `activation_max` over ``ids``
    with ``alpha``, those factors)."""
    factors = smoothing_factors(params, cfg, activation_max(params, cfg, ids), alpha)
    return fold(params, cfg, factors), factors


def served_params(params: dict, cfg, resolved, tokenizer) -> tuple[dict, dict | None]:
    """(``params`` as the engine serves them under ``resolved``, the smoothing factors or None):
    `smooth_params` with ``resolved.smoothquant`` over `calibration_ids` (needs a ``tokenizer``
    and an unquantised tree; else skipped), then `quantize_params` (``resolved.quantization``)."""
    from jaxinfer.engine.llm_engine import calibration_ids

    factors = None
    if resolved.smoothquant and tokenizer is not None and not is_quantized(params):
        params, factors = smooth_params(
            params, cfg, calibration_ids(tokenizer), resolved.smoothquant
        )
    if resolved.quantization is not None:
        params = quantize_params(params, cfg.weight_block_size)
    return params, factors
