"""The LoRA pool's fused layout (`jaxinfer.runner.lora`, `jaxinfer.models.lora`): per layer and
group of modules sharing an input, a [in, G, S, R] and block-diagonal b [G, S, R, out]. A slot's
arrays written then read back, b's blocks off its diagonal still zero; `add_lora`'s two GEMMs
equal to every module's own product (x @ A_s) @ B_s for each token's slot, concatenated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.lora.peft import GROUPS, MODULES, module_dims
from jaxinfer.models.lora import add_lora, at_layer, lora_step
from jaxinfer.runner.lora import init_pool, write_slot

CFG = ModelConfig("llama", 256, 64, 96, 2, 4, 2, 16)  # q 64, k/v 32, F 96
S, R = 3, 4


def _slot(seed: int) -> dict:
    """Random {module: {"a": [L, in, R], "b": [L, R, out]}} (f32, a slot's arrays)."""
    rng, L = np.random.default_rng(seed), CFG.num_layers
    return {
        m: dict(a=rng.standard_normal((L, i, R), np.float32), b=rng.standard_normal((L, R, o)))
        for m, (i, o) in module_dims(CFG).items()
    }


@pytest.fixture(scope="module")
def written():
    """(pool with slots 0 and 2 written, {slot: its arrays}); slot 1 empty."""
    slots = {0: _slot(0), 2: _slot(1)}
    pool = init_pool(CFG, S, R, jnp.float32)
    for s, arrays in slots.items():
        pool = write_slot(pool, s, arrays)
    return pool, slots


def test_slot_round_trip_keeps_b_block_diagonal(written):
    pool, slots = written
    dims = module_dims(CFG)
    for layer, groups in enumerate(pool):
        for g, p in groups.items():
            a, b, off = np.asarray(p["a"]), np.asarray(p["b"]), 0
            mask = np.ones(b.shape, bool)
            for j, m in enumerate(GROUPS[g]):
                o = dims[m][1]
                for s in range(S):
                    w = {k: v[layer] for k, v in slots[s][m].items()} if s in slots else {}
                    np.testing.assert_array_equal(a[:, j, s], w.get("a", 0))
                    np.testing.assert_allclose(b[j, s, :, off : off + o], w.get("b", 0), 1e-6)
                mask[j, :, :, off : off + o] = False
                off += o
            assert off == b.shape[-1] and not b[mask].any(), (layer, g)
    assert sorted(m for ms in GROUPS.values() for m in ms) == sorted(MODULES)


def test_add_lora_equals_each_modules_product(written):
    """Tokens of slots -1 (none), 0, 1 (empty), 2 in one [2, 3] batch, every layer and group."""
    pool, slots = written
    dims, rng = module_dims(CFG), np.random.default_rng(2)
    tok = np.array([[0, -1, 2], [1, 2, 0]], np.int32)
    lora = lora_step(pool, jnp.asarray(tok), jnp.float32)
    for layer in range(CFG.num_layers):
        for g, ms in GROUPS.items():
            i, out = dims[ms[0]][0], sum(dims[m][1] for m in ms)
            x, y = rng.standard_normal((2, 3, i)), rng.standard_normal((2, 3, out))
            got = add_lora(
                jnp.asarray(y, jnp.float32),
                jnp.asarray(x, jnp.float32),
                g,
                lora=at_layer(lora, layer),
            )
            want = y.copy()
            for bt in np.ndindex(tok.shape):
                if tok[bt] in slots:
                    A = [slots[tok[bt]][m] for m in ms]
                    want[bt] += np.concatenate([x[bt] @ w["a"][layer] @ w["b"][layer] for w in A])
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_write_slot_rejects_a_bad_slot_or_shape(written):
    pool = init_pool(CFG, S, R, jnp.float32)
    with pytest.raises(ValueError, match=r"LoRA slot 3 is invalid: the pool has slots \[0, 3\)"):
        write_slot(pool, 3, _slot(0))
    bad = _slot(0)
    bad["k_proj"]["b"] = bad["k_proj"]["b"][..., :-1]
    with pytest.raises(ValueError, match="LoRA slot arrays have shapes"):
        write_slot(pool, 0, bad)
    assert jax.tree.structure(pool) == jax.tree.structure(written[0])
