"""The fp8 runs of test_tensor_parallel.py's subprocess on 4 CPU devices: fp8 weights
(`fp8_weights`, `FP8_CFG` at tp 1 and 3) and the fp8 KV cache (`fp8_kv`, `FP8_KV_CFG` at tp 1, 2
and 4). Each returns a JSON-ready dict; the tests assert on it."""

import numpy as np

from tests.engine.tp_models import ENGINE, FP8_CFG, FP8_KV_CFG, PROMPTS, SPLIT

KV_GAINS = np.array([0.1, 10.0], np.float32)  # KV head j's K and V columns times KV_GAINS[j]
FP8_KV_TPS = (1, 2, 4)  # tp 4: each device a copy of one of the 2 KV heads


def _unit(x: np.ndarray) -> np.ndarray:
    """A matrix of init's N(0, 0.02) as N(0, 1/in): activations of size 1 into every layer."""
    return x if x.ndim < 2 else x / 0.02 * x.shape[0] ** -0.5


def fp8_weights(greedy) -> dict:
    """Greedy tokens of ``quantization="fp8"`` engines on `FP8_CFG` at tp 1 and 3, and the
    per-device shapes of the fp8 leaves and their scales at tp 3. Matrices N(0, 1/in) with columns
    scaled by 0.1..10 (shuffled): a scale laid out on the wrong column changes the tokens."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, models
    from jaxinfer.config import ModelConfig

    cfg, out, rng = ModelConfig(**FP8_CFG), {}, np.random.default_rng(2)

    def spread(x):
        cols = rng.permutation(np.logspace(-1, 1, x.shape[-1], dtype=np.float32))
        return x if x.ndim < 2 else _unit(x) * cols

    params = jax.tree.map(spread, models.init_params(cfg, jax.random.key(2), jnp.float32))
    for tp in (1, 3):
        llm = LLM.from_params(cfg, params, tensor_parallel_size=tp, quantization="fp8", **ENGINE)
        out[str(tp)] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
    layer = llm.engine.runner.params["layers"]["0"]
    out["shards"] = {
        k: list(x.sharding.shard_shape(x.shape)) for k, x in layer.items() if k.startswith(SPLIT)
    }
    return out


def fp8_kv(greedy) -> dict:
    """``kv_cache_dtype="fp8"`` engines on `FP8_KV_CFG` at each of `FP8_KV_TPS`: per tp the
    greedy tokens and the K/V means (f32[2, L, K', H]) of `ModelRunner.calibrate_kv`; at tp 1 also
    the tokens with the two heads' scales swapped ("swapped"). Matrices N(0, 1/in), KV head j's K
    and V times ``KV_GAINS[j]`` and its scales ``KV_GAINS[j] / 20`` (laid out on the K' heads by
    `kv_head_sources`): the large head read with the small head's scale is clipped at 448."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, models
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.kv_cache import put_heads
    from jaxinfer.runner.parallel import kv_head_sources

    cfg, out = ModelConfig(**FP8_KV_CFG), {}
    params = jax.tree.map(_unit, models.init_params(cfg, jax.random.key(3), jnp.float32))
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gains = np.tile(np.repeat(KV_GAINS, cfg.head_dim), 2)  # [2*K*H]: the k, then the v columns
    for layer in params["layers"].values():
        layer["wqkv"] = layer["wqkv"].at[:, NH : NH + 2 * KH].multiply(gains)
    scales = np.broadcast_to(KV_GAINS / 20, (cfg.num_layers, cfg.num_kv_heads))
    ids = np.arange(32) * 7 % cfg.vocab_size  # the calibration text: two pages

    def run(llm, tp, scales):  # the greedy tokens with these k_scale = v_scale f32[L, K]
        runner, src = llm.engine.runner, kv_head_sources(cfg, tp)
        runner.kv = runner.kv.replace(
            k_scale=put_heads(scales[:, src], runner.mesh),
            v_scale=put_heads(scales[:, src], runner.mesh),
        )
        llm.reset_prefix_cache()
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]

    for tp in FP8_KV_TPS:
        llm = LLM.from_params(cfg, params, tensor_parallel_size=tp, kv_cache_dtype="fp8", **ENGINE)
        runner = llm.engine.runner
        runner.calibrate_kv(ids)
        means = np.stack([np.asarray(runner.kv.k_mean), np.asarray(runner.kv.v_mean)])
        tokens = run(llm, tp, scales)
        pools = np.stack([np.asarray(runner.kv.k), np.asarray(runner.kv.v)])
        written = pools[:, :, pools.any(axis=(0, 1, 3, 4, 5))]
        out[str(tp)] = dict(tokens=tokens, means=means.tolist(), pages=written.tolist())
        if tp == 1:
            out["swapped"] = run(llm, tp, scales[:, ::-1])
    return out
