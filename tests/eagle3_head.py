"""A random EAGLE-3 head in the HF layout vLLM and SpecForge write (``LlamaForCausalLMEagle3``:
config.json, ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` over a draft vocabulary, ``d2t`` and
``t2d``) for a target `ModelConfig`, and a plain numpy EAGLE-3 head over its HF tensors (vLLM's
``llama_eagle3.py``) to check the engine's against. Imported by the EAGLE-3 tests."""

import json

import numpy as np
from safetensors.numpy import save_file

VD, AUX = 200, (0, 1, 2)  # the draft vocabulary; the target layers fc reads (tiny: L = 2)


def head_tensors(cfg, rng) -> dict:
    """Random HF tensors ([out, in]) of an EAGLE-3 head for target ``cfg``: matrices N(0, 1/in),
    norms near 1, d2t of a random draft vocabulary of `VD` target ids, t2d its mask."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def mat(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    ids = np.sort(rng.choice(V, VD, replace=False))
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    out = {
        "fc.weight": mat(D, 3 * D),
        a + "q_proj.weight": mat(NH, 2 * D),
        a + "k_proj.weight": mat(KH, 2 * D),
        a + "v_proj.weight": mat(KH, 2 * D),
        a + "o_proj.weight": mat(D, NH),
        m + "gate_proj.weight": mat(F, D),
        m + "up_proj.weight": mat(F, D),
        m + "down_proj.weight": mat(D, F),
        "lm_head.weight": mat(VD, D) * 4,
        "d2t": (ids - np.arange(VD)).astype(np.int64),
        "t2d": t2d,
    }
    norms = ("hidden_norm", "input_layernorm", "post_attention_layernorm")
    for n in [f"midlayer.{x}" for x in norms] + ["norm"]:
        out[n + ".weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return out


def head_config(cfg, **over) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": VD,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX)},
        **over,
    }


def write_head(path, cfg, tensors: dict, **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head_config(cfg, **config)))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta):  # x [n, heads, H], HF rotate_half
    H = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, H, 2) / H)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def reference_logits(hf: dict, cfg, embed, nxt, aux) -> np.ndarray:
    """f32[Vd]: the EAGLE-3 head (vLLM's llama_eagle3 in numpy, HF tensors) at its last entry,
    entries q = 0..n-1 being (embed[nxt[q]], fc(aux[q])), RoPE at position q."""
    eps, a, m = cfg.rms_norm_eps, "midlayer.self_attn.", "midlayer.mlp."
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = aux @ hf["fc.weight"].T
    x = np.concatenate(
        [
            rms(embed[nxt], hf["midlayer.input_layernorm.weight"], eps),
            rms(h, hf["midlayer.hidden_norm.weight"], eps),
        ],
        axis=-1,
    )
    pos = np.arange(len(nxt), dtype=np.float64)
    q = _rope((x @ hf[a + "q_proj.weight"].T).reshape(-1, N, H), pos, cfg.rope_theta)[-1]
    k = _rope((x @ hf[a + "k_proj.weight"].T).reshape(-1, K, H), pos, cfg.rope_theta)
    v = (x @ hf[a + "v_proj.weight"].T).reshape(-1, K, H)
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # [n, N, H]
    s = np.einsum("nh,snh->ns", q, k) / np.sqrt(H)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("ns,snh->nh", p / p.sum(-1, keepdims=True), v).reshape(-1)
    r = h[-1] + o @ hf[a + "o_proj.weight"].T
    y = rms(r, hf["midlayer.post_attention_layernorm.weight"], eps)
    g, u = y @ hf[m + "gate_proj.weight"].T, y @ hf[m + "up_proj.weight"].T
    r = r + (g / (1 + np.exp(-g)) * u) @ hf[m + "down_proj.weight"].T
    return rms(r, hf["norm.weight"], eps) @ hf["lm_head.weight"].T
