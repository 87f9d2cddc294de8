"""Tests for scripts/plan_memory.py's plans (`plan_memory`, `param_count`, fp8 weight bytes)
against hand counts; its CLI: tests/test_plan_memory_cli.py; the engine's pool sizing:
tests/test_memory_pool.py; the memory tracker: tests/test_memory_trace.py.

Every expected number is computed by hand here from published shapes / the seeds' example,
independently of the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from script_module import load_script

from jaxinfer.config import ModelConfig
from jaxinfer.config.memory import GIB, default_reserve_bytes

PLANNER = load_script("plan_memory")
MemoryPlan, PRESETS, plan_memory = PLANNER.MemoryPlan, PLANNER.PRESETS, PLANNER.plan_memory
param_count = PLANNER.param_count

QWEN3_8B = PRESETS["qwen3-8b"]

# Llama-3-70B shapes (published config): only L, K, H matter for KV; weights are given (4-bit).
LLAMA3_70B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
)


def test_qwen3_8b_kv_bytes_per_token():
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    assert plan.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    # fp8 and f32 KV scale the element size only.
    assert (
        plan_memory(
            QWEN3_8B, device_bytes=141 * GIB, context=4096, kv_dtype_bytes=1
        ).kv_bytes_per_token
        == 2 * 36 * 8 * 128 * 1
    )
    assert (
        plan_memory(
            QWEN3_8B, device_bytes=141 * GIB, context=4096, kv_dtype_bytes=4
        ).kv_bytes_per_token
        == 2 * 36 * 8 * 128 * 4
    )


def test_qwen3_8b_weight_bytes_hand_count():
    V, D, F, L, N, K, H = 151936, 4096, 12288, 36, 32, 8, 128
    embedding = V * D
    head = D * V  # untied
    q, k, v, o = D * N * H, D * K * H, D * K * H, N * H * D
    mlp = D * F + D * F + F * D
    norms = D + D + H + H  # input and post-attention RMSNorm, q_norm, k_norm
    per_layer = q + k + v + o + mlp + norms
    total = embedding + head + L * per_layer + D  # + final norm
    assert total == 8_190_735_360  # the published "8.2B" parameter count
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    assert plan.weight_bytes == 2 * total
    assert (
        plan_memory(
            QWEN3_8B, device_bytes=141 * GIB, context=4096, weight_dtype_bytes=4
        ).weight_bytes
        == 4 * total
    )
    # Tied head: the head matrix is not counted twice.
    tied = dataclasses.replace(QWEN3_8B, tie_word_embeddings=True)
    assert param_count(tied) == total - head


def _device_bytes(abstract, specs, tp: int) -> int:
    """Bytes one device holds of ``abstract`` (ShapeDtypeStructs) split by ``specs``."""
    import jax

    def shard_bytes(a, spec):
        shape = list(a.shape)
        for axis, name in enumerate(spec):
            if name is not None:
                assert shape[axis] % tp == 0, (a.shape, spec)
                shape[axis] //= tp
        return math.prod(shape) * a.dtype.itemsize

    return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(shard_bytes, abstract, specs)))


def test_param_count_matches_param_tree():
    import jax

    from jaxinfer import models  # imports jax; the layout source of truth

    for cfg in (QWEN3_8B, PRESETS["smollm2-135m"], LLAMA3_70B):
        # every layer has the same shapes: two layers check the per-layer count (faster trace)
        cfg = dataclasses.replace(cfg, num_layers=2)
        leaves = jax.tree_util.tree_leaves(models.abstract_params(cfg))
        assert param_count(cfg) == sum(math.prod(x.shape) for x in leaves)


@pytest.mark.parametrize("arch, tied, kv_heads", [("llama", True, 1), ("qwen3", False, 6)])
@pytest.mark.parametrize("block", [None, (8, 8)])
def test_counts_match_the_sharded_tree(arch, tied, kv_heads, block):
    """`param_count` and `fp8_weight_bytes` at tp 1, 2, 3 equal the bytes one device holds of
    `abstract_params` of `tp_model_config` split by `param_specs` (the structure of which is the
    tree's): float32 and fp8 (per channel, or in blocks), V = 96 split, V = 100 not at tp 3."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config.model import tp_model_config
    from jaxinfer.runner.parallel import param_specs

    cfg = ModelConfig(
        arch,
        100 if tied else 96,
        32,
        48,
        2,
        6,
        kv_heads,
        8,
        tie_word_embeddings=tied,
        weight_block_size=block,
    )
    for tp in (1, 2, 3):
        run = tp_model_config(cfg, tp)
        for quant in (None, "fp8"):
            abstract = models.abstract_params(run, jnp.float32, quant)
            specs = param_specs(cfg, tp, quant)
            assert jax.tree.structure(specs) == jax.tree.structure(abstract)
            got = _device_bytes(abstract, specs, tp)
            want = PLANNER.fp8_weight_bytes(cfg, 4, tp) if quant else 4 * param_count(cfg, tp)
            assert got == want, (tp, quant)


def test_qwen3_8b_on_h200_by_hand():
    dev = 141 * GIB
    plan = plan_memory(QWEN3_8B, device_bytes=dev, utilization=0.9, context=4096, page_size=16)
    weights = 2 * 8_190_735_360
    reserve = max(GIB, int(0.05 * dev))
    budget = int(dev * 0.9) - weights - reserve
    page = 16 * 147_456
    pages = budget // page
    assert plan.reserve_bytes == reserve == default_reserve_bytes(dev)
    assert plan.num_pages == pages
    assert plan.kv_pool_bytes == pages * page
    assert plan.kv_pool_bytes <= budget < plan.kv_pool_bytes + page
    assert plan.max_concurrent_seqs == (pages - 1) // (4096 // 16)
    assert plan.planned_concurrent_seqs == math.floor(0.7 * plan.max_concurrent_seqs)
    # 576 MiB per 4096-token sequence (SEEDS_DIGEST.md).
    assert plan.pages_per_seq * plan.page_bytes == 576 * 2**20


def test_seeds_llama3_70b_example():
    """Seeds: 70B 4-bit (48 GB) on a 192 GB B200, 16 GB reserve, 4096 ctx, fp16 KV.

    By hand: KV/token = 2*80*8*128*2 = 327,680 B; budget = 192 - 48 - 16 = 128 GB;
    128e9 / (4096 * 327,680) = 95.4 sequences (the seeds' "~240" does not follow from their own
    formula); paged with 16-token pages: 24,414 pages, 256 per sequence, 1 null page -> 95.
    """
    plan = plan_memory(
        LLAMA3_70B,
        device_bytes=192 * 10**9,
        utilization=1.0,
        context=4096,
        page_size=16,
        kv_dtype_bytes=2,
        reserve_bytes=16 * 10**9,
        weight_bytes=48 * 10**9,
    )
    kv_per_token = 2 * 80 * 8 * 128 * 2
    budget = 192 * 10**9 - 48 * 10**9 - 16 * 10**9
    assert plan.kv_bytes_per_token == kv_per_token == 327_680
    assert plan.num_pages == budget // (16 * kv_per_token) == 24_414
    assert plan.max_concurrent_seqs == budget // (4096 * kv_per_token) == 95
    assert plan.planned_concurrent_seqs == 66  # floor(0.7 * 95)


def test_partial_last_page_rounds_up():
    # context 4097 needs 257 pages of 16, so fewer sequences than at 4096.
    kw = dict(
        device_bytes=192 * 10**9,
        utilization=1.0,
        page_size=16,
        reserve_bytes=16 * 10**9,
        weight_bytes=48 * 10**9,
    )
    plan = plan_memory(LLAMA3_70B, context=4097, **kw)
    assert plan.pages_per_seq == 257
    assert plan.max_concurrent_seqs == (24_414 - 1) // 257


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("utilization", dict(utilization=0.0)),
        ("utilization", dict(utilization=1.5)),
        ("utilization", dict(utilization=-0.1)),
        ("context", dict(context=0)),
        ("context", dict(context=40961)),  # > max_position_embeddings
        ("page_size", dict(page_size=12)),
        ("page_size", dict(page_size=0)),
        ("device_bytes", dict(device_bytes=0)),
        ("kv_dtype_bytes", dict(kv_dtype_bytes=0)),
        ("reserve_bytes", dict(reserve_bytes=-1)),
        ("planning_fraction", dict(planning_fraction=0.0)),
    ],
)
def test_validation_names_field_and_value(field, kwargs):
    args = dict(device_bytes=141 * GIB, context=4096)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        plan_memory(QWEN3_8B, **args)
    msg = str(e.value)
    assert f"{field}={kwargs[field]!r}" in msg and "must be" in msg


def test_weights_do_not_fit_says_by_how_much():
    dev = 10 * GIB
    with pytest.raises(ValueError, match="weights do not fit") as e:
        plan_memory(QWEN3_8B, device_bytes=dev, utilization=0.9, context=4096)
    shortfall = 2 * 8_190_735_360 + GIB - int(dev * 0.9)
    assert f"{shortfall:,} B" in str(e.value)


def test_context_that_does_not_fit_one_sequence():
    # 20 GiB, util 1: budget = 20 GiB - weights - 1 GiB reserve; 40000 tokens need 2500 pages.
    dev = 20 * GIB
    pages = (dev - 2 * 8_190_735_360 - GIB) // (16 * 147_456)
    assert pages - 1 < 2500
    with pytest.raises(ValueError, match=r"context=40000 is invalid") as e:
        plan_memory(QWEN3_8B, device_bytes=dev, utilization=1.0, context=40000)
    assert f"context <= {(pages - 1) * 16} tokens" in str(e.value)


def test_table_is_readable():
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    t = plan.table()
    assert "147,456 B" in t and "144.0 KiB" in t
    assert f"{plan.weight_bytes / GIB:,.2f} GiB" in t
    assert f"{plan.max_concurrent_seqs:,}" in t and "planned (70%)" in t
    assert isinstance(plan, MemoryPlan)


def test_fp8_weight_bytes_equal_the_quantised_tree():
    """The plan's fp8 weight bytes (`fp8_weight_bytes`) equal the bytes of the tree
    `init_params(..., quantization="fp8")` builds (fp8 matrices, f32 scales, f32 rest)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config import ModelConfig

    fp8_weight_bytes = PLANNER.fp8_weight_bytes

    for arch, tied in (("qwen3", False), ("llama", True)):
        cfg = ModelConfig(arch, 96, 32, 64, 2, 4, 2, 8, tie_word_embeddings=tied)
        tree = models.init_params(cfg, jax.random.key(0), jnp.float32, "fp8")
        assert fp8_weight_bytes(cfg, 4) == sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def test_lora_pool_is_the_engines_and_comes_off_the_kv_budget(tiny_llm, tiny_cfg):
    """``lora=(S, R)`` (an engine with enable_lora): the plan's LoRA pool, its own table line,
    is the bytes of the arrays the engine allocates (the tiny model, float32 compute, 4 slots of
    rank 8; by hand: per layer, slot and rank, G x (in + out) of each fused group, qkv 3 x (64 +
    128), o 64 + 64, gate_up 2 x (64 + 192), down 96 + 64 = 1376 elements) and comes off the KV
    budget; LoRA off: no line, 0 bytes."""
    import jax

    llm = tiny_llm(text=False, enable_lora=True, max_loras=4, max_lora_rank=8, max_compiles=8)
    pool = jax.tree_util.tree_leaves(llm.engine.runner.params["lora"])
    allocated = sum(x.nbytes for x in pool)
    assert allocated == 4 * 2 * 4 * 8 * 1376 == 352_256
    kw = dict(device_bytes=4 * GIB, context=256, weight_dtype_bytes=4, reserve_bytes=GIB)
    plan, off = plan_memory(tiny_cfg, lora=(4, 8), **kw), plan_memory(tiny_cfg, **kw)
    assert plan.lora == (4, 8) and plan.lora_pool_bytes == allocated
    assert off.lora is None and off.lora_pool_bytes == 0
    budget = int(4 * GIB * 0.9) - plan.weight_bytes - GIB - allocated
    assert plan.num_pages == budget // plan.page_bytes < off.num_pages
    rows = {k.strip(): v for k, v in (line.split("  ", 1) for line in plan.table().splitlines())}
    assert rows["LoRA pool"].strip() == f"4 slot(s) x rank 8 = 0.00 GiB  ({allocated:,} B)"
    assert rows["KV budget"].strip() == f"{budget / GIB:,.2f} GiB  ({budget:,} B)"
    assert "LoRA pool" not in off.table()


@pytest.mark.parametrize(
    "preset,kwargs,needle",
    [
        ("qwen3-8b", dict(lora=(0, 16)), "EngineConfig.max_loras=0 is invalid: must be a positive"),
        ("qwen3-8b", dict(lora=(4, 16), tensor_parallel_size=2), "enable_lora runs on one device"),
        ("qwen3-30b-a3b", dict(lora=(4, 16)), "LoRA is not yet for mixture-of-experts models"),
        ("qwen3-8b", dict(lora=(64, 512), device_bytes=40 * GIB), "weights and the LoRA pool do"),
    ],
)
def test_lora_pool_the_engine_refuses(preset, kwargs, needle):
    """A LoRA pool the engine would refuse is the engine's one-line ValueError (its checks:
    `EngineConfig`, `_check_lora`); one that leaves no KV budget says by how much."""
    args = dict(device_bytes=141 * GIB, context=4096) | kwargs
    with pytest.raises(ValueError, match=needle) as e:
        plan_memory(PRESETS[preset], **args)
    assert "\n" not in str(e.value)
