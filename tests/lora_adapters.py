"""LoRA test helpers (importable from any test module): random PEFT adapter directories for a
`ModelConfig` written by hand in PEFT's file layout (``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's tensor names), and the independent reference: the
adapter merged into the base weights, ``W + scaling * A^T B^T`` per module, on the engine's fused
``wqkv`` ([q | k | v]) and ``w_gate_up`` ([gate | up]) columns (one device)."""

import json
import os

import numpy as np

from jaxinfer.lora.peft import module_dims as dims  # shapes only

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PART = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def random_tensors(cfg, rank: int, seed: int, modules=ALL, std: float = 0.3) -> dict:
    """PEFT-named random tensors: lora_A [r, in], lora_B [out, r] (B non-zero), float32."""
    rng, out = np.random.default_rng(seed), {}
    for layer in range(cfg.num_layers):
        for m in modules:
            i, o = dims(cfg)[m]
            base = f"base_model.model.model.layers.{layer}.{_PART[m]}.{m}"
            out[f"{base}.lora_A.weight"] = (
                rng.standard_normal((rank, i)) * std / np.sqrt(i) * 3
            ).astype(np.float32)
            out[f"{base}.lora_B.weight"] = (rng.standard_normal((o, rank)) * std).astype(np.float32)
    return out


def write_adapter(path, cfg, rank: int, seed: int, modules=ALL, alpha=16, rslora=False, **extra):
    """A PEFT LoRA directory at ``path``; returns (its tensors, scaling)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = random_tensors(cfg, rank, seed, modules)
    config = dict(
        peft_type="LORA",
        r=rank,
        lora_alpha=alpha,
        target_modules=list(modules),
        use_rslora=rslora,
        bias="none",
        **extra,
    )
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return tensors, alpha / (np.sqrt(rank) if rslora else rank)


def merged(params, cfg, tensors: dict, scaling: float):
    """``params`` with the adapter merged: each module's ``scaling * A^T B^T`` [in, out] added to
    its columns of the engine's fused weights (numpy float32 copies)."""
    import jax

    out = jax.tree.map(lambda a: np.array(a, np.float32), params)
    H, N, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    F = cfg.intermediate_size
    cols = dict(
        q_proj=("wqkv", 0, N * H),
        k_proj=("wqkv", N * H, (N + K) * H),
        v_proj=("wqkv", (N + K) * H, (N + 2 * K) * H),
        o_proj=("wo", 0, None),
        gate_proj=("w_gate_up", 0, F),
        up_proj=("w_gate_up", F, 2 * F),
        down_proj=("w_down", 0, None),
    )
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        layer, module = int(name.split(".layers.")[1].split(".")[0]), name.split(".")[-3]
        leaf, lo, hi = cols[module]
        w = out["layers"][str(layer)][leaf]
        w[:, lo:hi] += scaling * (a.T @ b.T)
    return out
