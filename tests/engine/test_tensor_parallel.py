"""Tensor parallelism (`jaxinfer.runner.parallel`) on 4 CPU devices. JAX fixes its device count
when it starts, so the checks run once in a subprocess of this file (`main`, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``) that prints one JSON object; the tests
assert on it. Reference: the same engine at tensor_parallel_size=1 (today's one-device path).
Models (tests/engine/tp_models.py): `CONFIGS`' Qwen3 and Llama at tp 1, 2 and 4 (tp=4 gives each
device a copy of one KV head); fp8 weights: `FP8_CFG` at tp 1 and 3 (3 of the 4 devices); the
fp8 KV cache: `FP8_KV_CFG` at tp 1, 2 and 4 (both fp8 runs: tests/engine/tp_fp8.py).
Multi-host: two CPU processes of ``jax.distributed`` with a local coordinator
(`main_two_processes`), a tp=2 mesh over their devices. On the host only (the layout of fp8
block scales, the per-device memory plan): test_tensor_parallel_layout.py."""

import json
import math
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.engine.tp_models import CONFIGS, ENGINE, FP8_CFG, FP8_KV_CFG, PROMPTS, SPLIT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TPS = (1, 2, 4)
COLLECTIVE = (
    r"= \w+\[([\d,]*)\]\S* "  # an HLO collective: (its shape, its kind)
    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)


def _logits(llm, prompt: list[int]) -> np.ndarray:
    """f32[T, V]: `forward` + `compute_logits` with the engine's params, pool and kernels on
    ``prompt``'s prefill (T positions, pages 1..; the decode path: `main`'s greedy tokens)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.runner.parallel import gather_logits

    eng, T = llm.engine, len(prompt)
    cfg, kernels, ps = eng.runner.run_config, eng.runner.executor.kernels, eng.page_size

    @jax.jit
    def run(params, kv, tokens, positions):
        slots = (1 + positions // ps) * ps + positions % ps
        kv = kv.replace(
            block_tables=jnp.arange(1, 5, dtype=jnp.int32)[None],
            seq_lens=jnp.full((1,), T, jnp.int32),
        )
        hidden, _ = models.forward(params, cfg, tokens, positions, slots, kv, kernels=kernels)
        return gather_logits(models.compute_logits(params, cfg, hidden), cfg, kernels.mesh)[0]

    return np.asarray(
        run(
            eng.runner.params,
            eng.runner._new_kv(),
            jnp.asarray([prompt], jnp.int32),
            jnp.arange(T)[None],
        )
    )


def _layout(llm, cfg, tp: int) -> dict:
    """Per-device shapes and bytes of the params and the KV pool, against `plan_memory`."""
    import jax
    from script_module import load_script

    from jaxinfer.config.memory import GIB

    plan_memory = load_script("plan_memory").plan_memory
    eng = llm.engine
    plan = plan_memory(
        cfg,
        device_bytes=2 * GIB,
        context=64,
        page_size=eng.page_size,
        weight_dtype_bytes=4,
        kv_dtype_bytes=4,
        tensor_parallel_size=tp,
    )
    leaves, full_copies, weight_bytes = (
        jax.tree_util.tree_leaves_with_path(eng.runner.params),
        [],
        0,
    )
    for path, x in leaves:
        name = path[-1].key
        shards = x.addressable_shards
        assert len(shards) == tp and all(
            s.data.shape == x.sharding.shard_shape(x.shape) for s in shards
        )
        split = name in SPLIT or (name in ("embed", "lm_head") and cfg.vocab_size % tp == 0)
        if split and tp > 1 and any(s.data.shape == x.shape for s in shards):
            full_copies.append(jax.tree_util.keystr(path))
        weight_bytes += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    k = eng.runner.kv.k
    return dict(
        weight_bytes=weight_bytes,
        plan_weight_bytes=plan.weight_bytes,
        full_copies=full_copies,
        kv_shard=list(k.sharding.shard_shape(k.shape)),
        kv_devices=len({s.device for s in k.addressable_shards}),
        kv_bytes=2 * math.prod(k.sharding.shard_shape(k.shape)) * k.dtype.itemsize,
        plan_kv_bytes=eng.runner.num_pages * plan.page_bytes,
    )


def _errors(params) -> dict:
    """The messages of a head count 4 does not divide and of more devices than there are
    (``params``: the Qwen3 model's; the head count fails before they are read)."""
    from jaxinfer import LLM
    from jaxinfer.config import ModelConfig

    out = {}
    for name, kw, tp in (
        ("heads", dict(CONFIGS["qwen3"], num_heads=6), 4),
        ("devices", CONFIGS["qwen3"], 8),
    ):
        try:
            LLM.from_params(ModelConfig(**kw), params, tensor_parallel_size=tp, **ENGINE)
        except ValueError as e:
            out[name] = str(e)
    return out


def main() -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, SamplingParams, models
    from jaxinfer.config import ModelConfig
    from tests.engine.tp_fp8 import fp8_kv, fp8_weights

    out = {"devices": jax.device_count()}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for arch, kw in CONFIGS.items():
        cfg = ModelConfig(**kw)
        params = models.init_params(cfg, jax.random.key(1), jnp.float32)
        on_host = jax.tree.map(np.asarray, params)  # what the HF loader gives at tp > 1
        out.setdefault("errors", _errors(params))
        for tp in TPS:
            llm = LLM.from_params(
                cfg, on_host if tp == 2 else params, tensor_parallel_size=tp, **ENGINE
            )
            res = out[f"{arch}/{tp}"] = _layout(llm, cfg, tp)
            res["logits"] = _logits(llm, PROMPTS[1]).tolist()
            llm.precompile(PROMPTS, greedy)  # ahead-of-time steps take the engine's arrays
            res["collectives"] = [
                re.findall(COLLECTIVE, exe.as_text())
                for (program, _), exe in llm.engine.runner.executor.executables.items()
                if program == "forward"
            ]
            res["sampler_collectives"] = [
                re.findall(COLLECTIVE, exe.as_text())
                for (program, _), exe in llm.engine.runner.executor.executables.items()
                if program != "forward"
            ]
            res["tokens"] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
            res["lazy_compiles"] = llm.engine.stats().num_lazy_compiles
            llm.update_params(params)  # the canonical tree, resharded
            res["tokens_after_update"] = [
                list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)
            ]
    out["orbax_tp2"] = _from_checkpoint(ModelConfig(**CONFIGS["qwen3"]), greedy)
    out["fp8"] = fp8_weights(greedy)
    out["fp8_kv"] = fp8_kv(greedy)
    print(json.dumps(out))


def _from_checkpoint(cfg, greedy) -> list[list[int]]:
    """Greedy tokens of `LLM` on an Orbax checkpoint of `main`'s Qwen3 params at tp=2 (the
    loader hands host arrays to the sharding)."""
    import tempfile

    import jax
    import jax.numpy as jnp
    from script_module import load_script

    from jaxinfer import LLM, models

    with tempfile.TemporaryDirectory() as d:
        params = models.init_params(cfg, jax.random.key(1), jnp.float32)
        load_script("convert_checkpoint").save_checkpoint(
            os.path.join(d, "ck"), cfg, params, None, ()
        )
        llm = LLM(os.path.join(d, "ck"), skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]


def _env(XLA_FLAGS: str = "") -> dict:
    """This environment on the CPU, ``XLA_FLAGS`` added to the inherited ones (conftest's)."""
    flags = " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), XLA_FLAGS)))
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=flags)


@pytest.fixture(scope="module")
def result():
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        cwd=ROOT,
        text=True,
        env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_processes():
    """The JSON lines of `main_two_processes` in processes 0 and 1 (a local coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(i), str(port)],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_four_cpu_devices(result):
    assert result["devices"] == 4


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("tp", TPS[1:])
def test_logits_match_one_device(result, arch, tp):
    ref = np.asarray(result[f"{arch}/1"]["logits"])
    got = np.asarray(result[f"{arch}/{tp}"]["logits"])
    assert ref.shape == got.shape == (len(PROMPTS[1]), CONFIGS[arch]["vocab_size"])
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("tp", TPS[1:])
def test_greedy_tokens_match_one_device(result, arch, tp):
    ref, got = result[f"{arch}/1"], result[f"{arch}/{tp}"]
    assert got["tokens"] == ref["tokens"] and len(got["tokens"][1]) == 8
    assert got["tokens_after_update"] == ref["tokens"]
    assert got["lazy_compiles"] == 0  # the precompiled steps accepted the sharded arrays


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("tp", TPS)
def test_collectives_move_activations_not_weights(result, arch, tp):
    """In each compiled forward (ragged and decode): an all-reduce of the hidden state [.., D]
    after the vocabulary-split embedding and after wo and w_down of each layer, and one
    all-gather of the logits [R, V] where lm_head is split; nothing else (no weight is
    gathered); the samplers, on whole logits, none."""
    c, steps = CONFIGS[arch], result[f"{arch}/{tp}"]["collectives"]
    split_vocab = tp > 1 and c["vocab_size"] % tp == 0
    assert len(steps) == 2
    samplers = result[f"{arch}/{tp}"]["sampler_collectives"]
    assert samplers and all(ops == [] for ops in samplers)
    for ops in steps:
        shapes = {
            kind: [[int(d) for d in s.split(",")] for s, k in ops if k == kind]
            for kind in ("all-reduce", "all-gather")
        }
        assert len(ops) == sum(map(len, shapes.values()))
        assert len(shapes["all-reduce"]) == (2 * c["num_layers"] + split_vocab if tp > 1 else 0)
        assert all(s[-1] == c["hidden_size"] and len(s) == 3 for s in shapes["all-reduce"])
        assert [s[-1] for s in shapes["all-gather"]] == [c["vocab_size"]] * split_vocab
        assert all(len(s) == 2 and s[0] <= ENGINE["max_num_seqs"] for s in shapes["all-gather"])


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("tp", TPS)
def test_per_device_shapes_match_the_plan(result, arch, tp):
    r, c = result[f"{arch}/{tp}"], CONFIGS[arch]
    assert r["weight_bytes"] == r["plan_weight_bytes"]
    assert r["kv_bytes"] == r["plan_kv_bytes"]
    kv_heads = max(c["num_kv_heads"], tp) // tp  # tp=4: one copy per device
    assert r["kv_shard"] == [c["num_layers"], ENGINE["num_pages"], kv_heads, 16, c["head_dim"]]
    assert r["kv_devices"] == tp
    assert r["full_copies"] == []


def test_checkpoint_loaded_at_tp2_matches_one_device(result):
    assert result["orbax_tp2"] == result["qwen3/1"]["tokens"]


def test_fp8_at_tp3_matches_one_device(result):
    """fp8 weights at tp=3 (per channel: K-major [out, in]): wqkv and w_gate_up with their
    per-channel scales split by output channel (the one KV head copied to each device), wo and
    w_down by input channel with whole scales; tokens as tp=1."""
    r, c = result["fp8"], FP8_CFG
    assert r["3"] == r["1"] and len(r["1"][1]) == 8
    D, F, H, N = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_heads"]
    qkv = (N + 2 * 3) * H // 3
    assert r["shards"] == {
        "wqkv": [qkv, D],
        "wqkv_scale": [qkv],
        "wo": [D, N * H // 3],
        "wo_scale": [D],
        "w_gate_up": [2 * F // 3, D],
        "w_gate_up_scale": [2 * F // 3],
        "w_down": [D, F // 3],
        "w_down_scale": [D],
    }


def test_fp8_kv_matches_one_device(result):
    """fp8 KV at tp 2 and 4 (each device a copy of one KV head): the calibrated K/V means and the
    written pages' bytes are the one-device ones of each K' head's source head, and the greedy
    tokens are the one-device tokens, with per-head scales that change the tokens when two heads
    swap them (as a device reading another device's scales would)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.runner.parallel import kv_head_sources

    r, cfg = result["fp8_kv"], ModelConfig(**FP8_KV_CFG)
    means, pages = np.asarray(r["1"]["means"]), np.asarray(r["1"]["pages"])  # heads: axes 2, 3
    assert np.abs(means).max() > 0.1 and r["swapped"] != r["1"]["tokens"]
    for tp in (2, 4):
        src, got = kv_head_sources(cfg, tp), r[str(tp)]
        np.testing.assert_allclose(got["means"], means[:, :, src], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["pages"], pages[:, :, :, src])
        assert got["tokens"] == r["1"]["tokens"] and len(got["tokens"][1]) == 8


def test_errors_name_both_numbers(result):
    assert "num_heads=6 is not divisible by tensor_parallel_size=4" in result["errors"]["heads"]
    assert (
        "tensor_parallel_size=8 is invalid: JAX sees 4 cpu device(s)" in result["errors"]["devices"]
    )


def test_two_processes_match_one_device(result, two_processes):
    """``jax.distributed`` on one machine: a tp=2 mesh over two processes' CPU devices, each
    process running the same host loop, gives the one-device tokens in both."""
    for r in two_processes:
        assert (r["devices"], r["local"]) == (2, 1)
        assert r["tokens"] == result["qwen3/1"]["tokens"]


def main_two_processes(process_id: int, port: int) -> None:
    """One of two CPU processes (one device each) of ``jax.distributed``, both running the same
    host loop: Qwen3 greedy tokens at tensor_parallel_size 2 (both processes' devices)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp

    from jaxinfer import LLM, SamplingParams, models
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig(**CONFIGS["qwen3"])
    params = models.init_params(cfg, jax.random.key(1), jnp.float32)
    llm = LLM.from_params(cfg, params, tensor_parallel_size=2, **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print(
        json.dumps(
            {
                "devices": jax.device_count(),
                "local": len(jax.local_devices()),
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
            }
        )
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    if len(sys.argv) > 1:
        main_two_processes(int(sys.argv[1]), int(sys.argv[2]))
    else:
        main()
