"""Qwen3-MoE (issue 47, CPU): a tiny random HF ``Qwen3MoeForCausalLM`` (3 layers, layer 1 dense
through ``mlp_only_layers``, E = 8, top-2, D = 64) saved by ``save_pretrained`` and run by
``LLM(path)``: greedy tokens equal HF's ``generate`` and log-probabilities HF's ``log_softmax``
within 1e-4 (absolute, as tests/e2e/test_logprobs_vs_hf.py), batched and alone; `moe_mlp`
against a dense masked reference; the routing on ties against HF's router and MoE block; fp8
experts against float32 on the dequantised tree."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_model import TINY_ENGINE  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.config.weights import QUANTIZED  # noqa: E402
from jaxinfer.models.kernels import MIXED_TRITON_MAX_ROWS, GroupedGemm  # noqa: E402
from jaxinfer.models.moe import moe_mlp, route  # noqa: E402
from pallas_kernels import moe_gemm  # noqa: E402

TOL = 1e-4  # log-probabilities, absolute (float32 on both sides)
SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
STEPS = 12


def hf_moe(seed: int = 0, **kw):
    """A tiny random HF Qwen3-MoE model (float32, eval), every weight random, norms around 1."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SIZES, **kw}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    model = hf_moe()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def moe_llm(moe_checkpoint):
    return LLM(str(moe_checkpoint[0]), skip_tokenizer_init=True, **TINY_ENGINE)


def test_config_from_the_saved_checkpoint(moe_checkpoint):
    path, _ = moe_checkpoint
    cfg = ModelConfig.from_checkpoint(path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob and cfg.qk_norm
    assert [cfg.is_sparse(i) for i in range(3)] == [True, False, True]
    # Qwen's own config.json names E num_experts (transformers 5 writes num_local_experts)
    raw = json.loads((path / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    assert ModelConfig.from_hf_config(raw) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_experts_per_tok", 9, r"num_experts_per_tok=9 .*\[1, num_experts=8\]"),
        ("moe_intermediate_size", 0, r"moe_intermediate_size=0 .*positive"),
        ("decoder_sparse_step", 0, r"decoder_sparse_step=0 .*positive"),
        ("mlp_only_layers", (3,), r"mlp_only_layers=\(3,\) .*\[0, num_layers=3\)"),
    ],
)
def test_config_errors_name_the_field(moe_checkpoint, field, value, match):
    cfg = ModelConfig.from_checkpoint(moe_checkpoint[0])
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**cfg.to_dict(), field: value, "rope_scaling": None})
    with pytest.raises(ValueError, match=r"num_experts=4 .*0 unless architecture"):
        ModelConfig(**{**cfg.to_dict(), "architecture": "qwen3", "num_experts": 4})


def test_decoder_sparse_step():
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = ModelConfig("qwen3_moe", 256, 64, 96, 4, 4, 2, 16, **moe)
    step2 = ModelConfig(**{**cfg.to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": (3,)})
    assert [step2.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert all(cfg.is_sparse(i) for i in range(4))


def greedy_hf(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
        toks = out[0, len(ids) :].tolist()
        logits = model(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1 :]
    return toks, torch.log_softmax(logits, dim=-1).numpy()


def check_output(out, model, ids):
    toks, ref = greedy_hf(model, ids, STEPS)
    assert list(out.token_ids) == toks
    for entry, r, t in zip(out.logprobs, ref, toks):
        assert abs(entry[t].logprob - r[t]) <= TOL and entry[t].rank == 1
        for tok, lp in entry.items():  # the top 3 too
            assert abs(lp.logprob - r[tok]) <= TOL


def test_greedy_and_logprobs_match_hf_batched_and_alone(moe_llm, moe_checkpoint):
    model = moe_checkpoint[1]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (13, 5, 21)]
    sp = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    batched = moe_llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    alone = moe_llm.generate([{"prompt_token_ids": prompts[1]}], sp)
    for out, ids in zip(batched, prompts):
        check_output(out.outputs[0], model, ids)
    check_output(alone[0].outputs[0], model, prompts[1])


def test_params_are_the_weight_table(moe_llm, moe_checkpoint):
    from jaxinfer.config.weights import device_bytes

    layers = moe_llm.engine.runner.params["layers"]
    assert layers["0"]["router"].shape == (64, 8)
    assert layers["0"]["w_experts_gate_up"].shape == (8, 64, 64)
    assert layers["2"]["w_experts_down"].shape == (8, 32, 64)
    assert "router" not in layers["1"] and layers["1"]["w_gate_up"].shape == (64, 192)
    assert "w_gate_up" not in layers["0"]
    cfg = moe_llm.engine.resolved.model
    assert device_bytes(cfg) == sum(p.numel() for p in moe_checkpoint[1].parameters())


def dense_reference(x, router, w_gate_up, w_down, top_k, norm):
    """Every expert on every token in f32, weighted by the routing mask (0 where not chosen)."""
    x = x.astype(jnp.float32)
    probs = jax.nn.softmax(x @ router, axis=-1)  # [T, E]
    kth = jnp.sort(probs, axis=-1)[:, -top_k][:, None]
    gate = jnp.where(probs >= kth, probs, 0.0)  # no ties in random data
    gate = gate / gate.sum(-1, keepdims=True) if norm else gate
    Fe = w_down.shape[1]
    gu = jnp.einsum("td,edf->tef", x, w_gate_up)
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(gu[..., :Fe]) * gu[..., Fe:], w_down)
    return jnp.einsum("te,ted->td", gate, y)


@pytest.mark.parametrize("gemm", ["ragged_dot", "triton"])
@pytest.mark.parametrize("E,k,norm,T", [(8, 2, True, 37), (4, 3, False, 5), (6, 1, True, 1)])
def test_moe_mlp_matches_dense_reference(E, k, norm, T, gemm):
    """Both grouped GEMMs (`GroupedGemm`; the Pallas kernel in interpret mode) against every
    expert on every token."""
    keys = jax.random.split(jax.random.key(E * 10 + k), 4)
    D, Fe = 64, 32
    x = jax.random.normal(keys[0], (T, D))
    router = jax.random.normal(keys[1], (D, E)) * 0.3
    wgu = jax.random.normal(keys[2], (E, D, 2 * Fe)) * D**-0.5
    wd = jax.random.normal(keys[3], (E, Fe, D)) * Fe**-0.5
    got = jax.jit(moe_mlp, static_argnames=("top_k", "norm_topk_prob", "gemm"))(
        x[None], router, wgu, wd, top_k=k, norm_topk_prob=norm, gemm=GroupedGemm(gemm, True)
    )[0]
    want = dense_reference(x, router, wgu, wd, k, norm)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def tied_block(E=6, D=8, seed=0):
    """HF's MoE block whose router rows 1 and 3 are equal (the two likeliest for the tokens
    below) and rows 0 and 4 equal (the two least likely): exact ties inside and outside the
    top-2, none across its boundary. Returns (block, tokens [T, D])."""
    cfg = transformers.Qwen3MoeConfig(
        **{**SIZES, "hidden_size": D, "num_experts": E, "moe_intermediate_size": 4}
    )
    torch.manual_seed(seed)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    u = torch.randn(D)
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 0.5)
        block.experts.down_proj.normal_(0, 0.5)
        w = 0.05 * torch.randn(E, D)
        w[1] = w[3] = u
        w[0] = w[4] = -u
        block.gate.weight.copy_(w)
    x = 2.0 * u / u.norm() ** 2 + 0.01 * torch.randn(5, D)
    return block, x


def test_routing_ties_match_hf():
    block, x = tied_block()
    with torch.no_grad():
        _, hf_w, hf_idx = block.gate(x)
        hf_out = block(x[None])[0].numpy()
    router = jnp.asarray(block.gate.weight.detach().numpy().T)
    w, idx = route(jnp.asarray(x.numpy()), router, 2, True)
    for a, b, wa, wb in zip(np.asarray(idx), hf_idx.numpy(), np.asarray(w), hf_w.numpy()):
        assert sorted(a) == sorted(b) == [1, 3]  # the chosen set: HF's
        np.testing.assert_allclose(wa[np.argsort(a)], wb[np.argsort(b)], rtol=1e-6)
    assert np.asarray(idx)[:, 0].tolist() == [1] * 5  # ties: the lower expert index first
    gu = jnp.asarray(block.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1))
    down = jnp.asarray(block.experts.down_proj.detach().numpy().transpose(0, 2, 1))
    out = moe_mlp(jnp.asarray(x.numpy()), router, gu, down, top_k=2, norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(out), hf_out, rtol=1e-5, atol=1e-6)
    # every expert tied (a zero router): the k lowest indices, each weighted 1/k (HF's weights;
    # torch.topk on the CPU keeps other indices here, libstdc++'s nth_element order)
    w, idx = route(jnp.ones((2, 8)), jnp.zeros((8, 6)), 2, True)
    assert np.asarray(idx).tolist() == [[0, 1]] * 2 and np.allclose(np.asarray(w), 0.5)


def _deq(name: str, w, scale) -> np.ndarray:
    """float32 [.., in, out] of fp8 ``w`` and its per-channel ``scale``: the dense layers' K-major
    [out, in] matrices transposed back, the experts' [E, in, out] stacks as they are."""
    w, scale = np.asarray(w).astype(np.float32), np.asarray(scale)
    return (w * scale[:, None]).T if name in QUANTIZED else w * scale[..., None, :]


def dequantised(params: dict) -> dict:
    """The float32 tree of the values an fp8 tree means: each ``<name>_scale`` (per output
    channel, [out] or the experts' [E, out]) multiplied into its matrix (numpy, `_deq`)."""
    layers = {}
    for i, layer in params["layers"].items():
        layers[i] = {
            k: _deq(k, v, layer[k + "_scale"]) if k + "_scale" in layer else v
            for k, v in layer.items()
            if not k.endswith("_scale")
        }
    return {**params, "layers": layers}


def test_fp8_experts_equal_float32_on_dequantised_weights(moe_checkpoint):
    """quantization="fp8" quantises the experts per (expert, output channel) too: greedy tokens
    and log-probabilities equal a float32 engine's on the dequantised tree."""
    fp8 = LLM(str(moe_checkpoint[0]), skip_tokenizer_init=True, quantization="fp8", **TINY_ENGINE)
    params = fp8.engine.runner.params
    sparse = params["layers"]["0"]
    assert sparse["w_experts_gate_up"].dtype == jnp.float8_e4m3fn
    assert sparse["w_experts_down_scale"].shape == (8, 64)
    assert sparse["w_experts_down"].shape == (8, 32, 64)  # [E, in, out]: not K-major
    assert params["layers"]["1"]["w_down"].dtype == jnp.float8_e4m3fn  # the dense layer
    ref = LLM.from_params(fp8.engine.model_config, dequantised(params), **TINY_ENGINE)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 42]}, {"prompt_token_ids": list(range(30, 50))}]
    sp = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    for g, w in zip(fp8.generate(prompts, sp), ref.generate(prompts, sp)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp_g, lp_w = (
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in (g, w)
        )
        np.testing.assert_allclose(lp_g, lp_w, rtol=1e-4, atol=1e-4)


def test_checkpoint_name_errors(moe_checkpoint):
    from checkpoints_tools.loader import iter_tensors
    from jaxinfer.runner.loading import params_from_hf

    path = moe_checkpoint[0]
    cfg = ModelConfig.from_checkpoint(path)
    state = dict(iter_tensors(path))  # as saved: one tensor per expert and projection
    name = "model.layers.2.mlp.experts.7.up_proj.weight"
    with pytest.raises(ValueError, match=r"missing tensors.*experts\.7\.up_proj"):
        params_from_hf({k: v for k, v in state.items() if k != name}, cfg, jnp.float32)
    dense = {"model.layers.0.mlp.down_proj.weight": np.zeros((64, 96), np.float32)}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*layer 0 has no param"):
        params_from_hf({**state, **dense}, cfg, jnp.float32)
    extra = {"model.layers.0.mlp.experts.8.up_proj.weight": np.zeros((32, 64), np.float32)}
    with pytest.raises(ValueError, match=r"expert index 8 >= num_experts=8"):
        params_from_hf({**state, **extra}, cfg, jnp.float32)


def test_engine_features_on_moe(moe_checkpoint):
    """Issue 47 item 4: prefix caching (a shared 32-token prefix, pages hit by the later call),
    n = 2 and n-gram speculation (repetitive prompts draft) on the MoE model: greedy tokens equal
    HF's ``generate``."""
    path, model = moe_checkpoint
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        speculative_config=spec,
        **TINY_ENGINE,
    )
    prompts = [[5, 6, 7, 8] * 8 + [9 + i] * (i + 1) for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, n=2)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], sp)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp)
    for out, ids in zip(first + rest, prompts):
        want, _ = greedy_hf(model, ids, STEPS)
        assert [list(c.token_ids) for c in out.outputs] == [want, want]
    st = llm.engine.stats()
    assert st.prefix_cache_hits >= 32 and st.spec_num_drafts > 0


@pytest.mark.parametrize(
    "M, kernel", [(MIXED_TRITON_MAX_ROWS, True), (MIXED_TRITON_MAX_ROWS + 1, False)]
)
def test_mixed_grouped_gemm_picks_the_kernel_by_rows(monkeypatch, M, kernel):
    """ "mixed": the Pallas kernel up to `MIXED_TRITON_MAX_ROWS` routed rows, ragged_dot above."""
    calls = []
    monkeypatch.setattr(
        moe_gemm, "grouped_gemm", lambda xs, w, sizes, **kw: calls.append(xs.shape) or xs @ w[0]
    )
    xs, w = jnp.ones((M, 16)), jnp.ones((2, 16, 32))
    out = GroupedGemm("mixed")(xs, w, jnp.array([M, 0], jnp.int32))
    assert out.shape == (M, 32) and calls == ([(M, 16)] if kernel else [])
    np.testing.assert_allclose(np.asarray(out), 16.0)
