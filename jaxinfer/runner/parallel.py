"""Tensor parallelism through JAX sharding (XLA inserts the collectives): the "tp" mesh, weight and
KV-pool shardings (`param_specs`, from `jaxinfer.config.weights`), and the canonical (one-device)
-> engine weight layout (`shard_params`, `engine_layout`). Sources: Megatron-LM (column-split qkv,
gate/up; row-split wo, down); vLLM (vocabulary-split embedding and lm_head, KV heads copied)."""

import jax
import numpy as np
from flax.traverse_util import unflatten_dict
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import weights
from jaxinfer.config.model import ModelConfig, check_tp, tp_model_config
from jaxinfer.models.kv_cache import AXIS
from jaxinfer.models.quantize import FP8, is_quantized


def make_mesh(tp: int) -> Mesh:
    """1-D mesh `AXIS` over the first ``tp`` of ``jax.devices()``; ValueError if fewer."""
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tp} is invalid: JAX sees {len(devices)} "
            f"{devices[0].platform} device(s)"
        )
    return Mesh(np.array(devices[:tp]), (AXIS,))


def local(x: jax.Array) -> jax.Array:
    """A replicated ``x``'s copy on this process's first device of it (``x`` itself when one
    process holds all of it), for reading back on a host of a multi-process mesh."""
    return x if x.is_fully_addressable else x.addressable_data(0)


def replicated(mesh: Mesh | None) -> NamedSharding | None:
    """The sharding of arrays every device holds whole (page tables, step inputs); None: none."""
    return None if mesh is None else NamedSharding(mesh, P())


def gather_logits(logits: jax.Array, cfg: ModelConfig, mesh: Mesh | None) -> jax.Array:
    """``logits`` f32[..., V] (traced) made whole on every device of ``mesh`` (None: as is), split
    by vocabulary first where lm_head is (XLA never gathers lm_head)."""
    if mesh is None:
        return logits
    if cfg.vocab_size % mesh.size == 0:
        spec = P(*(None,) * (logits.ndim - 1), AXIS)
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(logits, replicated(mesh))


def param_specs(cfg: ModelConfig, tp: int, quantization: str | None = None) -> dict:
    """PartitionSpecs shaped as ``abstract_params(cfg, quantization=...)``: "tp" on the split axis
    of each leaf (`weights.entries`: wqkv, w_gate_up, wo, w_down, V if tp divides it)."""
    return unflatten_dict(
        {
            path: P() if split is None else P(*(None,) * split, AXIS)
            for path, _, _, split in weights.entries(cfg, tp, quantization)
        }
    )


def kv_head_sources(cfg: ModelConfig, tp: int) -> np.ndarray:
    """int[K']: the canonical KV head that each of the K' KV heads of the engine layout at tp
    devices (`tp_model_config`) holds, head j a copy of head j*K//K'."""
    K, K2 = cfg.num_kv_heads, tp_model_config(cfg, tp).num_kv_heads
    return np.arange(K2) * K // K2


def engine_layout(name: str, w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """Leaf ``name`` of the canonical tree of ``cfg`` in the engine layout of tp devices: wqkv [D,
    (N+2K)*H] -> [D, (N+2K')*H] as [q_0 | k_0 | v_0 | q_1 | ...] (q_s: query heads s*N/tp.., k_s,
    v_s: KV heads s*K'/tp.., copied as `kv_head_sources`); w_gate_up: [gate_0 | up_0 | ...]
    (w_experts_gate_up per expert alike); their fp8 forms alike: per-channel matrices K-major
    [out, in] (`weights.kmajor`, told by their float8_e4m3fn dtype) by row, their scales [.., out];
    block scales [.., in/bi, out/bo] by block, whole blocks (`check_tp`)."""
    parts = weights.fused_parts(cfg).get(name.removesuffix("_scale"))
    if parts is None:
        return w
    K, H = cfg.num_kv_heads, cfg.head_dim
    groups = [np.arange(s.start, s.stop) for s in parts.values()]  # canonical columns
    if name.startswith("wqkv"):  # the KV heads, copied where tp > K
        groups[1:] = [g.reshape(K, H)[kv_head_sources(cfg, tp)] for g in groups[1:]]
    cols = np.concatenate([g.reshape(tp, -1) for g in groups], axis=1).reshape(-1)
    bo = cfg.weight_block_size and cfg.weight_block_size[0]
    if bo and name.endswith("_scale"):  # block scales [.., in/bi, out/bo]
        return w[..., cols[::bo] // bo]
    if w.dtype == FP8 and weights.kmajor(name, cfg.weight_block_size):
        return w[..., cols, :]  # K-major [out, in]
    return w[..., cols]  # matrices [.., in, out], per-channel scales [.., out]


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Canonical ``params`` of ``cfg`` (jax or numpy leaves, fp8 too) -> engine layout on ``mesh``,
    each device getting only its shard; shapes: ``abstract_params(tp_model_config(cfg, tp))``.
    ValueError: a model tp cannot split, fp8 blocks not whole on each device (`check_tp`)."""
    tp, quantization = mesh.size, "fp8" if is_quantized(params) else None
    check_tp(cfg, tp)

    def place(path, w, spec):
        host = engine_layout(path[-1].key, np.asarray(w), cfg, tp)
        return jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, spec), lambda index: host[index]
        )

    return jax.tree_util.tree_map_with_path(place, params, param_specs(cfg, tp, quantization))
