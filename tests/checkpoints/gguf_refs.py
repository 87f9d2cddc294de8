"""What the GGUF tests share: the HF reference's tensors, and prefill logits of our model over a
paged KV cache, both in float32."""

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_tools.loader import hf_tensors, open_checkpoint
from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models.kv_cache import init_kv_cache

PAGE_SIZE = 16


def load_gguf_hf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF-style config dict, {HF name: f32 array}) of a GGUF file."""
    ckpt = open_checkpoint(path)
    return ckpt.config, dict(hf_tensors(ckpt))


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def paged_prefill_logits(params, cfg: ModelConfig, tokens: list[int]) -> np.ndarray:
    """f32[T, V] logits of one prompt through models.forward over a fresh paged KV cache
    (pages assigned in reverse order so the block table is not the identity)."""
    T = len(tokens)
    n_pages = -(-T // PAGE_SIZE)
    kv = init_kv_cache(cfg, n_pages + 2, PAGE_SIZE, jnp.float32)
    pages = np.arange(n_pages + 1, 1, -1, dtype=np.int32)  # never page 0
    pos = np.arange(T, dtype=np.int32)
    slots = pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    kv = kv.replace(block_tables=jnp.asarray(pages[None]), seq_lens=jnp.asarray([T], jnp.int32))

    @jax.jit
    def run(params, tok, pos, slots, kv):
        hidden, _ = models.forward(params, cfg, tok, pos, slots, kv)
        return models.compute_logits(params, cfg, hidden)

    with jax.default_matmul_precision("highest"):  # f32 reference: no TF32 on GPUs
        out = run(
            params,
            jnp.asarray([tokens], jnp.int32),
            jnp.asarray(pos[None]),
            jnp.asarray(slots[None]),
            kv,
        )
    return np.asarray(out[0], np.float32)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
