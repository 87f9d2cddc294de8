"""Acceptance: the JAX Llama/Qwen3 models match HF transformers (torch, float32) logit for logit.

Tiny random HF models are saved with ``save_pretrained`` (single file and sharded), loaded through
`jaxinfer.runner.loading.load_model`, and run over the paged KV cache: a prefill of 2 ragged,
padded prompts, then 20 greedy decode steps. Page size 4 or 8 (sequences cross several pages), a
shuffled block table, page 0 never assigned. Every step's logits are compared with HF's
full-sequence forward over the same tokens: relative error ``||a - b|| / ||b|| < 1e-4`` per
sequence and step.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxinfer import models  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.config.weights import device_bytes as param_count  # noqa: E402 (compute_bytes 1)
from jaxinfer.models.kv_cache import KVCache  # noqa: E402
from jaxinfer.runner.loading import load_model  # noqa: E402

REL_TOL = 1e-4
N_DECODE = 20


# ----------------------------------------------------------------------------- helpers (shared)
def make_hf_model(arch: str, seed: int = 0, **kw):
    """A tiny random HF model (float32, eval mode) with every weight random, norms included."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    base.update(kw)
    config_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[
        arch
    ]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)  # norms: random around 1, never all ones
            else:
                p.copy_(0.15 * noise)
    return model


def hf_numpy_state(model) -> dict[str, np.ndarray]:
    """The model's state dict as float32 numpy arrays (tied lm_head included, as torch lists it)."""
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def hf_logits(model, tokens) -> np.ndarray:
    """HF float32 logits [S, V] of one unpadded token sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].float().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.partial(jax.jit, static_argnums=(1,))
def _step(params, cfg, tokens, positions, slot_mapping, kv):
    hidden, kv = models.forward(params, cfg, tokens, positions, slot_mapping, kv)
    return models.compute_logits(params, cfg, hidden), kv, hidden


class PagedLayout:
    """Numpy block tables for B sequences: a permutation of pages 1..P-1 (page 0 = null page)."""

    def __init__(self, batch: int, max_len: int, page_size: int, seed: int = 0):
        self.page_size = page_size
        self.max_pages = -(-max_len // page_size)
        self.num_pages = 1 + batch * self.max_pages + 3  # a few pages left unused
        perm = np.random.default_rng(seed).permutation(np.arange(1, self.num_pages))
        self.block_tables = perm[: batch * self.max_pages].reshape(batch, self.max_pages)
        self.block_tables = self.block_tables.astype(np.int32)

    def slot(self, b: int, pos: int) -> int:
        return (
            int(self.block_tables[b, pos // self.page_size]) * self.page_size + pos % self.page_size
        )


def run_paged_greedy(
    params,
    cfg: ModelConfig,
    prompts,
    n_decode: int,
    page_size: int,
    dtype=jnp.float32,
    seed: int = 0,
):
    """Prefill the ragged ``prompts`` (padded into one [B, T] batch), then greedy-decode.

    Returns (tokens per sequence: prompt + the n_decode fed tokens, logits per sequence
    [len + n_decode, V] (row i: logits after token i), hidden dtype of the prefill, final KVCache).
    """
    B = len(prompts)
    lens = [len(p) for p in prompts]
    T = max(lens)
    layout = PagedLayout(B, T + n_decode, page_size, seed)
    pool = (cfg.num_layers, layout.num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    k_pool, v_pool = jnp.zeros(pool, dtype), jnp.zeros(pool, dtype)
    block_tables = jnp.asarray(layout.block_tables)

    tokens = np.zeros((B, T), np.int32)
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    slots = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : lens[b]] = p
        for t in range(T):
            # padded tokens write into the null page
            slots[b, t] = layout.slot(b, t) if t < lens[b] else t % page_size
    kv = KVCache(k_pool, v_pool, block_tables, jnp.asarray(lens, jnp.int32))
    logits, kv, hidden = _step(
        params, cfg, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slots), kv
    )
    logits = np.asarray(logits)
    out_logits = [[logits[b, t] for t in range(lens[b])] for b in range(B)]
    seqs = [list(p) for p in prompts]
    cur = list(lens)
    for _ in range(n_decode):
        nxt = [int(np.argmax(out_logits[b][-1])) for b in range(B)]
        for b in range(B):
            seqs[b].append(nxt[b])
        tok = np.asarray(nxt, np.int32)[:, None]
        pos = np.asarray(cur, np.int32)[:, None]
        slot = np.asarray([[layout.slot(b, cur[b])] for b in range(B)], np.int32)
        cur = [c + 1 for c in cur]
        kv = kv.replace(seq_lens=jnp.asarray(cur, jnp.int32))
        logits, kv, _ = _step(
            params, cfg, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(slot), kv
        )
        logits = np.asarray(logits)
        for b in range(B):
            out_logits[b].append(logits[b, 0])
    return seqs, [np.stack(x) for x in out_logits], hidden.dtype, kv


def assert_matches_hf(model, seqs, logits, prompt_lens):
    """Per sequence: prefill rows (all prompt positions) and each decode step vs HF."""
    for b, (seq, lg) in enumerate(zip(seqs, logits)):
        ref = hf_logits(model, seq)
        n = prompt_lens[b]
        err = rel_err(lg[:n], ref[:n])
        assert err < REL_TOL, f"seq {b} prefill: rel err {err:.2e}"
        for j in range(n, lg.shape[0]):
            err = rel_err(lg[j], ref[j])
            assert err < REL_TOL, f"seq {b} decode step {j - n}: rel err {err:.2e}"


# ----------------------------------------------------------------------------- tests
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    # name: (arch, hf config overrides, page_size, sharded save)
    "llama-gqa1-tied": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
        4,
        False,
    ),
    "llama-gqa2-untied-sharded": (
        "llama",
        dict(num_hidden_layers=3, num_key_value_heads=2),
        8,
        True,
    ),
    "llama-gqa4-llama3rope": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
        4,
        False,
    ),
    "qwen3-tied": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=True), 4, False),
    "qwen3-gqa4-untied-sharded": (
        "qwen3",
        dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2),
        8,
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_hf(case, tmp_path):
    arch, overrides, page_size, sharded = CASES[case]
    model = make_hf_model(arch, seed=len(case), **overrides)
    save_kw = {"max_shard_size": "40KB"} if sharded else {}
    model.save_pretrained(tmp_path, **save_kw)  # transformers 5 always writes safetensors
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == sharded
    cfg, params = load_model(tmp_path, jnp.float32, with_tokenizer=False)[:2]
    assert cfg.architecture == arch
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    if "rope_parameters" in overrides:
        assert cfg.rope_scaling is not None

    rng = np.random.default_rng(len(case))
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (11, 5)]
    seqs, logits, hdtype, kv = run_paged_greedy(params, cfg, prompts, N_DECODE, page_size)
    assert hdtype == jnp.float32
    if cfg.rope_scaling is not None:  # the scaling must matter at these positions
        assert max(len(s) for s in seqs) > cfg.rope_scaling.original_max_position_embeddings
    assert_matches_hf(model, seqs, logits, [len(p) for p in prompts])
    # Nothing valid was written outside the assigned pages: unassigned pages stay zero.
    bt = np.asarray(kv.block_tables)
    unused = sorted(set(range(1, kv.k.shape[1])) - set(bt.ravel().tolist()))
    assert unused and not np.any(np.asarray(kv.k)[:, unused])


def test_bf16_compute_close_to_hf(tmp_path):
    """bf16 params, KV and residual stream: dtypes stay bf16 and logits are within bf16 error."""
    model = make_hf_model("qwen3", seed=3)
    model.save_pretrained(tmp_path)
    cfg, params = load_model(tmp_path, jnp.bfloat16, with_tokenizer=False)[:2]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    prompts = [np.random.default_rng(3).integers(0, cfg.vocab_size, size=9).tolist()]
    seqs, logits, hdtype, kv = run_paged_greedy(params, cfg, prompts, 2, 4, dtype=jnp.bfloat16)
    assert hdtype == jnp.bfloat16 and kv.k.dtype == jnp.bfloat16
    ref = hf_logits(model, seqs[0])
    err = rel_err(logits[0], ref)
    assert err < 3e-2, f"bf16 rel err {err:.2e}"


def expected_shapes(cfg: ModelConfig) -> dict:
    """The documented layout (`jaxinfer.models.llama`), written out by hand."""
    V, D, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = {
        "attn_norm": (D,),
        "wqkv": (D, (N + 2 * K) * H),
        "wo": (N * H, D),
        "mlp_norm": (D,),
        "w_gate_up": (D, 2 * F),
        "w_down": (F, D),
    }
    if cfg.qk_norm:
        layer.update(q_norm=(H,), k_norm=(H,))
    shapes = {
        "embed": (V, D),
        "layers": {str(i): layer for i in range(cfg.num_layers)},
        "final_norm": (D,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen3", False)])
def test_abstract_params_match_the_layout(arch, tied):
    cfg = ModelConfig(arch, 256, 64, 96, 3, 8, 2, 16, tie_word_embeddings=tied)
    abstract = models.abstract_params(cfg, jnp.bfloat16)
    shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), abstract)
    assert shapes == expected_shapes(cfg)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(abstract))
    params = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), params) == jax.tree_util.tree_map(
        lambda x: (x.shape, x.dtype), abstract
    )
    assert param_count(cfg) * 2 == sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("tied", [True, False])
def test_abstract_params_one_trace_serves_every_dtype_and_tying(tied):
    """Unquantised, `abstract_params` derives each dtype and tying from one float32 trace of the
    untied model: the same tree as tracing the modules' init in that dtype (MoE layers too)."""
    cfg = ModelConfig(
        *("qwen3_moe", 128, 64, 96, 2, 4, 2, 16),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=(0,),
        tie_word_embeddings=tied,
    )
    for dtype in (jnp.float32, jnp.bfloat16):
        traced = jax.eval_shape(models._init_fn(cfg, dtype), jax.random.key(0))
        got = models.abstract_params(cfg, dtype)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(
            lambda x: (x.shape, x.dtype), traced
        )
        assert ("lm_head" in got) != tied


def test_abstract_params_qwen3_8b_without_allocating():
    """Qwen3-8B's tree at its real size, by eval_shape: shapes and 8,190,735,360 params."""
    cfg = ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, tie_word_embeddings=False)
    abstract = models.abstract_params(cfg, jnp.bfloat16)
    assert jax.tree_util.tree_map(lambda x: tuple(x.shape), abstract) == expected_shapes(cfg)
    assert abstract["layers"]["35"]["wqkv"].shape == (4096, 6144)
    assert abstract["lm_head"].shape == (4096, 151936)
    assert param_count(cfg) * 2 == 2 * 8_190_735_360


def test_check_params_rejects_mismatched_tree(tiny_cfg, tiny_params):
    cfg = tiny_cfg
    params = jax.tree.map(lambda x: x, tiny_params)  # a copy of the dicts: edited below
    models.check_params(params, cfg)
    wqkv = params["layers"]["0"]["wqkv"]
    params["layers"]["0"]["wqkv"] = wqkv.T
    with pytest.raises(
        ValueError,
        match=r"params/layers/0/wqkv has shape \(128, 64\), "
        r"expected \(64, 128\)",
    ):
        models.check_params(params, cfg)
    params["layers"]["0"]["wqkv"] = wqkv
    del params["layers"]["1"]["q_norm"]
    with pytest.raises(ValueError, match="q_norm"):
        models.check_params(params, cfg)
