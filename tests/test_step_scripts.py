"""The scripts around the engine's step (no GPU): plan_step_shapes.py (the planned set, the
host-only workload dry run), decode_step.py (bench_decode.py's runner, kernel and GEMM choices,
decode knobs), probes/step_trace.py (one line per engine step) and bench_spec.py (--tiny)."""

import os

import numpy as np
import pytest
from script_module import ROOT, load_script


def test_dry_run_emits_every_requested_token_once():
    plan = load_script("plan_step_shapes")
    from jaxinfer.step_input import BucketSpec

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(5, 60, 12)]
    out_lens = [int(n) for n in rng.integers(1, 30, 12)]
    buckets = BucketSpec.build(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, page_size=8, vocab_size=100
    )
    res = plan.simulate(
        prompts,
        out_lens,
        num_pages=40,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=96,
        buckets=buckets,
    )
    # every prompt token is prefilled once (preemption would recompute: the pool is large enough)
    assert res["prefill_tokens"] == sum(len(p) for p in prompts)
    assert res["ragged_tokens_padded"] >= res["ragged_tokens"] > 0
    # the first token of each request comes from its last prefill chunk, each later one from one
    # decode row (in a decode-only or a mixed step); at most 4 rows per step
    assert res["decode_rows"] == sum(out_lens) - len(out_lens)
    assert sum(res["steps"].values()) >= res["decode_rows"] / 4
    assert sum(s["steps"] for s in res["shapes"]) == sum(res["steps"].values())
    assert res["num_shapes"] == len(res["shapes"])
    # shapes come from the steps' StepShapes: decode T = R a row bucket, ragged T a token bucket
    # over min(T, 4) rows; greedy requests: every shape is in the planned set
    for s in res["shapes"]:
        if s["forward"] == "decode":
            assert s["tokens"] == s["rows"] and s["tokens"] in buckets.batch
        else:
            assert s["tokens"] in buckets.tokens and s["rows"] == min(s["tokens"], 4)
        assert (s["sampler"], s["bias"], s["prompt"], s["planned"]) == ("greedy", 0, 0, True)


def test_planned_set_of_the_bench_configuration():
    """plan_step_shapes.py's table of `BucketSpec.planned` for the bench's configuration (256
    rows, 8,192 tokens, 2,048 context, Qwen3-8B's vocabulary): 23 forwards, 33 samplers."""
    import subprocess
    import sys

    from jaxinfer.step_input import BucketSpec

    plan = load_script("plan_step_shapes")
    buckets = BucketSpec.build(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        page_size=16,
        vocab_size=151936,
    )
    p = plan.planned_set(buckets)
    assert (p["forwards"], p["samplers"], p["full_bias"]) == (23, 33, 128)
    assert p["decode_rows"] == [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]
    assert p["ragged_tokens"] == [32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert p["sampler_rows"] == p["decode_rows"] and p["levels"] == ["greedy", "sample", "full"]
    script = os.path.join(ROOT, "scripts", "plan_step_shapes.py")
    r = subprocess.run(
        [sys.executable, script, "--no-workload", "--max-model-len", "2048"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "23 forwards (11 decode, 12 ragged) and 33 samplers" in r.stdout
    assert "decode rows       11  1 2 4 8 16 32 64 96 128 192 256" in r.stdout
    r = subprocess.run(
        [sys.executable, script, "--no-workload", "--token-buckets", "64", "32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--token-buckets 64 32: must be strictly increasing" in r.stderr


def test_decode_runner_runs_the_engines_forward_and_sampler(tiny_cfg, tiny_params):
    """decode_step's runner on the CPU: the engine's forward then its greedy sampler give the
    argmax of the forward's logits, the same with inputs packed every step or sent once."""
    import jax.numpy as jnp

    ds = load_script("decode_step")
    kc = ds.resolve_kernels(tiny_cfg, "", "cpu")
    assert ds.check_against_reference(tiny_cfg, tiny_params, kc, {}, 3, 40, 16) == 0.0
    sizes = ds.decode_sizes(tiny_cfg, 4, 40, 16)
    hb = ds.host_batch(sizes, 4, 40, 16, True, tiny_cfg.vocab_size)
    assert (hb.shape.forward, hb.shape.sampler.level) == ((4, True, 0, 0), "greedy")
    assert hb.block_tables.shape == (4, 3) and sorted(hb.block_tables.ravel()) == list(range(1, 13))
    pool = jnp.full((2, 13, 2, 16, 16), 0.01, jnp.bfloat16)
    (logits, _), _ = ds._FORWARD(
        tiny_params,
        ds.kv_pool(pool, pool),
        jnp.asarray(ds.pack(hb, "forward")),
        jnp.zeros((4,), jnp.int32),
        key=hb.shape.forward,
        sizes=sizes,
        cfg=tiny_cfg,
        kernels=ds.ModelKernels(),
    )
    for inputs in ds.INPUT_MODES:
        run, kv, backend = ds.step_runner(
            tiny_cfg, tiny_params, kc, {}, "engine", inputs, 4, 40, 16, True
        )
        toks, kv = run(kv)
        assert backend == "xla"
        np.testing.assert_array_equal(np.asarray(toks), np.argmax(np.asarray(logits), -1))
        dt, kv = ds.time_steps(run, kv, 2, warmup=1)
        assert dt > 0
    with pytest.raises(ValueError, match="inputs='fixed'"):
        ds.decode_runner(tiny_cfg, tiny_params, ds.ModelKernels(), "xla", 4, 40, 16, inputs="fixed")


def test_step_trace_records_each_steps_shape(tiny_llm, tmp_path, capsys):
    """probes/step_trace.py: one line per `LLMEngine.step` call with the launched step's
    `StepShape` (a ragged prefill, then decode steps) and the lazy compiles, and a summary."""
    from jaxinfer import SamplingParams

    trace = load_script("probes/step_trace")
    llm, path = tiny_llm(text=False), str(tmp_path / "trace.jsonl")
    tr = trace.StepTrace(llm.engine, path)
    try:
        tr.mark("run")
        llm.generate(
            [{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}] * 2,
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        )
    finally:
        del llm.engine.step  # the engine's own method again
    tr.f.close()
    import json

    rows = [json.loads(line) for line in open(path)][1:]
    shapes = [r["shape"] for r in rows if r["shape"] is not None]
    # 12 prompt tokens: ragged T = 32 (rows min(T, 8)), then decode steps of the 8-row bucket
    assert shapes[0] == [[32, False], [8, "greedy"], 0]
    assert shapes[1:] == [[[8, True], [8, "greedy"], 0]] * (len(shapes) - 1) and len(shapes) > 1
    assert rows[0]["prefill"] and not any(r["prefill"] for r in rows[1:])
    trace.summarize(path)
    assert "run: " in capsys.readouterr().out


def test_decode_knobs_parse_and_reach_the_kernel(monkeypatch):
    import jax.numpy as jnp

    from jaxinfer.config import KernelConfig
    from jaxinfer.models import kernels

    bench = load_script("decode_step")  # bench_decode.py's step
    assert bench.parse_knobs("") == {}
    assert bench.parse_knobs("num_splits=4,block_kv=128") == {"num_splits": 4, "block_kv": 128}
    for bad in ("num_splits", "num_splits=x", "=3", "a b=1"):
        with pytest.raises(ValueError, match="name=integer"):
            bench.parse_knobs(bad)
    seen = {}

    def fake_decode(q, k_pool, v_pool, block_tables, seq_lens, *, layer, scale, **knobs):
        seen.update(knobs)
        return q

    monkeypatch.setattr(kernels.registry, "get", lambda name: fake_decode)
    mosaic = KernelConfig("mosaic", "reference")
    attn = kernels.model_kernels(mosaic, decode_knobs={"num_splits": 3}).attention
    q = jnp.ones((2, 1, 4, 8))
    out = attn(
        q,
        jnp.zeros((1, 2, 2, 4, 8)),
        jnp.zeros((1, 2, 2, 4, 8)),
        jnp.zeros((2, 1), jnp.int32),
        jnp.ones((2,), jnp.int32),
        jnp.zeros((2, 1), jnp.int32),
        layer=0,
        scale=0.5,
    )
    # "mosaic" also gets its layer as the page-offset array (mosaic.layer_offsets)
    assert seen.pop("page_offset").shape == (32,)
    assert out.shape == q.shape and seen == {"num_splits": 3}
    with pytest.raises(ValueError, match="reference has no knobs"):
        kernels.model_kernels(
            KernelConfig("reference", "reference"), decode_knobs={"num_splits": 3}
        )


def test_bench_decode_defaults_to_the_engines_kernels():
    """bench_decode's default spec "" resolves as the engine does (jaxinfer.config.resolve) and
    each batch gets the engine's GEMM back-end (cuBLAS from cublas_decode_min_batch rows)."""

    from jaxinfer.config import ModelConfig

    bench = load_script("decode_step")  # bench_decode.py's step
    cfg = ModelConfig(**bench.QWEN3_8B)
    gpu = bench.resolve_kernels(cfg, "", "gpu")
    assert (gpu.decode_attention, gpu.prefill_attention) == ("mosaic", "triton")
    assert [bench.engine_gemm(gpu, b) for b in (1, 63, 64, 256)] == [
        "xla",
        "xla",
        "cublas",
        "cublas",
    ]
    no_cublas = bench.resolve_kernels(cfg, "cublas_decode_min_batch=none", "gpu")
    assert bench.engine_gemm(no_cublas, 256) == "xla"
    fp8 = bench.resolve_kernels(cfg, "", "gpu", quantization="fp8")  # cuBLAS cannot fuse e4m3
    assert bench.engine_gemm(fp8, 256) == "xla"
    cpu = bench.resolve_kernels(cfg, "", "cpu")
    assert cpu.decode_attention == "reference"
    with pytest.raises(ValueError, match="GPU kernel"):
        bench.resolve_kernels(cfg, "decode=mosaic", "cpu")
    assert bench.knob_error(gpu, {"num_splits"}) is None
    assert "not knobs of decode attention 'mosaic'" in bench.knob_error(gpu, {"bogus"})
    assert "its knobs: none" in bench.knob_error(cpu, {"num_splits"})


def test_bench_spec_tiny_rows(tmp_path):
    """bench_spec.py's tiny CPU mode: plain rows, oracle rows at B = 1 (rate 0: every draft
    rejected; 0.9: most accepted) and above the auto-off threshold (k = 4 at the wide rate
    only); the JSON lines are the returned rows, ratios come from the row's own timings and its
    plain row's, greedy outputs equal plain decoding's, the timed runs compiled nothing."""
    import json

    bench = load_script("bench_spec")
    out = tmp_path / "spec.jsonl"
    argv = ["--tiny", "--batches", "1,20", "--ks", "4", "--rates", "0,0.9", "--out", str(out)]
    rows = bench.main(argv)
    assert [json.loads(line) for line in open(out)] == rows
    assert [(r["batch"], r["k"], r["rate"]) for r in rows] == [
        (1, 0, None),
        (20, 0, None),
        (1, 4, 0.0),
        (1, 4, 0.9),
        (20, 4, 0.8),
    ]
    plain = {r["batch"]: r for r in rows if r["k"] == 0}
    for r in rows:
        assert r["bench"] == "spec" and r["device"] and "commit" in r and "date" in r
        p = plain[r["batch"]]
        assert r["plain_ms_per_token"] == p["ms_per_token"] > 0
        assert r["ratio"] == pytest.approx(r["ms_per_token"] / p["ms_per_token"])
        assert r["step_ratio"] == pytest.approx(r["ms_per_step"] / p["ms_per_step"])
        assert r["e2e_ratio"] == pytest.approx(r["e2e_ms_per_token"] / p["e2e_ms_per_token"])
        assert r["lazy_compiles"] == 0 and r["repeatable"] and r["mismatched_rows"] == []
        assert r["tokens"] == r["batch"] * 16 and r["accepted"] <= r["draft_tokens"]
        if r["drafts"]:
            assert r["mean_acceptance_length"] == pytest.approx(1 + r["accepted"] / r["drafts"])
    zero, high = rows[2], rows[3]
    assert zero["drafts"] > 0 and zero["accepted"] == 0 and zero["mean_acceptance_length"] == 1
    assert high["accepted"] > high["drafts"] and sum(high["accepted_per_pos"]) == high["accepted"]
    assert plain[1]["drafts"] == 0 and plain[1]["ratio"] == 1.0
