"""Pure helpers of the scripts in scripts/ and scripts/probes/ (no GPU): trace arithmetic of
profile_decode_step.py, the decode GEMM forms, every ported script's --help, argument checks. The
scripts around the engine's step (plan_step_shapes.py, decode_step.py, step_trace.py):
tests/test_step_scripts.py."""

import os

import numpy as np
import pytest
from script_module import ROOT, load_script


def test_busy_time_is_the_union_of_kernel_intervals():
    prof = load_script("profile_decode_step")
    # [0, 10) and [5, 12) overlap (two streams): 12; [20, 25): 5; [21, 22) inside it: 0
    events = [("a", 0, 10), ("b", 5, 7), ("c", 20, 5), ("d", 21, 1)]
    assert prof.busy_ns(events) == 17
    assert prof.busy_ns([]) == 0
    assert prof.short("loop_add_fusion_12") == "loop_add_fusion"
    assert prof.short("gemm_fusion_dot_3_1") == "gemm_fusion_dot"


def test_layer_sequence_is_one_layer_in_launch_order():
    prof = load_script("profile_decode_step")
    # two "layers": gemm, attn (anchor), add; the sequence runs from attn #1 to attn #2 (exclusive)
    events = [
        ("gemm_0", 0, 5),
        ("attn_mosaic", 7, 2),
        ("add_1", 10, 1),
        ("gemm_2", 20, 5),
        ("attn_mosaic", 30, 2),
        ("add_3", 33, 1),
        ("gemm_4", 40, 5),
        ("attn_mosaic", 50, 2),
    ]
    seq = prof.layer_sequence(list(reversed(events)), "mosaic", which=1)
    assert [r["kernel"] for r in seq] == ["attn_mosaic", "add_3", "gemm_4"]
    assert [r["gap_us_before"] for r in seq] == [0.0, 0.001, 0.006]
    assert prof.layer_sequence(events, "mosaic", which=2) == []  # no later anchor


def test_largest_gaps_name_the_kernels_around_them():
    prof = load_script("profile_decode_step")
    # idle [10, 20) between a and b; c overlaps b (another stream), then idle [40, 45) before d
    events = [("d", 45, 5), ("a", 0, 10), ("b", 20, 10), ("c", 25, 15)]
    gaps = prof.largest_gaps(events)
    assert gaps == [
        {"us": 0.01, "before": "a", "after": "b"},
        {"us": 0.005, "before": "c", "after": "d"},
    ]
    assert prof.largest_gaps(events, top=1) == gaps[:1]
    assert prof.largest_gaps([("a", 0, 5), ("b", 2, 9)]) == []


def test_decode_gemm_formulations_compute_the_same_product():
    """bench_decode_gemm's explicit split-K forms: partial sums that add up to x @ w, and their
    sum in x's dtype (CPU, float32)."""
    import jax
    import jax.numpy as jnp
    import pytest

    bench = load_script("probes/bench_decode_gemm")
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 64), jnp.float32)
    w = jax.random.normal(kw, (64, 16), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    (plain,) = bench.gemm_fn("xla")([x], [w])
    (parts,) = bench.gemm_fn("cublas-partials4")([x], [w])
    (summed,) = bench.gemm_fn("xla-split2")([x], [w])
    assert parts.shape == (4, 3, 16) and parts.dtype == jnp.float32
    for got in (plain, parts.sum(0), summed):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="unknown variant 'cuda'"):
        bench.gemm_fn("cuda")
    with pytest.raises(ValueError, match="K=64 is not divisible by S=3"):
        bench.gemm_fn("xla-partials3")([x], [w])
    for bad in ("xla-partials0", "cublas-split0"):
        with pytest.raises(ValueError, match=">= 1"):
            bench.gemm_fn(bad)


def test_decode_gemm_kmajor_fp8_equals_the_engine_dense():
    """The fp8 variants (the weight K-major [N, K], as the engine stores it; the ``t`` names the
    same GEMMs) give the engine's `layers.dense` product exactly (CPU, bf16 x)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.models.layers import Weight, dense
    from jaxinfer.models.quantize import quantize_fp8

    bench = load_script("probes/bench_decode_gemm")
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (4, 64), jnp.bfloat16)
    w8, scale = quantize_fp8(jax.random.normal(kw, (64, 32), jnp.bfloat16) * 0.02)
    assert w8.shape == (32, 64)  # [N, K]
    for kind in ("w8a16", "w8a8"):
        want = dense(x, Weight(w8, scale, w8a8=kind == "w8a8"))
        for name in (kind, kind + "t"):
            (got,) = bench.gemm_fn("xla-" + name)([x], [(w8, scale)])
            assert got.shape == (4, 32) and float(jnp.abs(want).max()) > 0
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "script",
    [
        "decode_step",
        "bench_decode",
        "profile_decode_step",
        "bench_serving",
        "bench_startup",
        "plan_step_shapes",
        "bench_host_overhead",
        "bench_structured",
        "probes/cache_key_probe",
        "probes/probe_step_memory",
        "probes/startup_profile",
        "probes/step_trace",
        "probes/bench_decode_gemm",
        "probes/bench_act_quant",
        "probes/probe_l2_prefetch",
    ],
)
def test_script_help(script):
    """Each ported script answers ``--help`` (no device work, exit 0)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", script + ".py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_trace_summary_outside_the_run_is_an_error_not_a_crash(tmp_path):
    bench = load_script("bench_throughput")
    log = bench.TracedStepLog(5, 3, str(tmp_path))
    for i in range(2):
        log.append(i)
    out = bench.trace_summary(log)
    assert "none inside the traced window" in out["error"] and not log.active


def test_bench_prefix_cache_tiny_runs_every_mode(tmp_path):
    """bench_prefix_cache.py --tiny on the CPU: every mode runs, checks its tokens (cache on vs
    off identical; n samples equal independent requests) and writes one JSON row per run."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rows.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_prefix_cache.py"),
            "--tiny",
            "--kernels",
            "batch_buckets=8,token_buckets=64",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["mode"], x["prefix_caching"]) for x in rows] == [
        ("shared", False),
        ("shared", True),
        ("no-shared", False),
        ("no-shared", True),
        ("rl", True),
        ("rl", True),
        ("rl", True),
    ]
    shared_off, shared_on = rows[0], rows[1]
    assert shared_off["hit_rate"] == 0 and shared_on["hit_rate"] > 0.3
    assert shared_on["cached_tokens"] > 0 and rows[3]["compiles_in_timed_run"] == 0
    assert all(x["output_tokens"] > 0 and x["bench"] == "prefix_cache" for x in rows)
    assert [rows[i]["token_match"] for i in (1, 3, 5, 6)] == [1.0] * 4  # float32: identical


def test_eval_accuracy_agreement_and_arguments():
    acc = load_script("eval_accuracy")
    # equal up to the first divergence only: 2/4, then 4/4 (a later match does not count)
    assert acc.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]]) == 0.75
    assert acc.agreement([[1, 2]], [[3, 2]]) == 0.0
    assert acc.parse_args(["--tokens", "1024", "--chunk", "256"]).kv_cache_dtype == "fp8"
    for bad in (["--tokens", "1000"], ["--chunk", "100", "--tokens", "1000"], ["--prompts", "0"]):
        try:
            acc.parse_args(bad)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{bad} accepted")


def test_bench_structured_mask_replay_accepts_its_documents(smollm_path):
    """bench_structured.py's mask timing replays valid documents: every token is allowed by its
    row's mask, no matcher fails, and one time per step comes back (host only, no device)."""
    from checkpoints_tools.loader import load_tokenizer
    from jaxinfer.engine.structured import StructuredOutputManager

    bench = load_script("bench_structured")
    tok = load_tokenizer(smollm_path, "gguf")
    manager = StructuredOutputManager(tok, 49152, [tok.eos_token_id])
    for schema in bench.SCHEMAS.values():
        times = bench.mask_times(manager, tok, 3, schema)
        assert len(times) > 100 and (times > 0).all()
