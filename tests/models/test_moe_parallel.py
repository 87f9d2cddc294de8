"""Qwen3-MoE under tensor parallelism (each expert's F_e split over the devices, the partial
outputs summed: `jaxinfer.models.moe`): on 2 CPU devices, greedy tokens and log-probabilities at
tensor_parallel_size=2 equal the one-device engine's (float32, fp8 experts, and an HF FP8
checkpoint's block-scaled experts: tests/checkpoints/test_fp8_moe_checkpoint.py). JAX fixes its
device count when it starts, so the engines run in a subprocess of this file (`main`) that
prints one JSON object; the reference is the same model at tp=1 there (tests/models/test_moe.py
checks tp=1 against HF transformers)."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 17, 99, 3, 42], list(range(30, 50)), [7, 7, 200, 1]]
TOL = 1e-4


def main() -> None:
    """Save the tiny HF MoE model and an HF FP8 checkpoint (block scales) of one, run them at tp
    1 and 2 (float32, fp8 quantised at load, the FP8 checkpoint), print the outputs."""
    from tiny_model import TINY_ENGINE

    from jaxinfer import LLM, SamplingParams
    from tests.checkpoints.test_fp8_moe_checkpoint import write_fp8_moe
    from tests.models.test_moe import hf_moe

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    out = {}
    with tempfile.TemporaryDirectory() as path:
        hf_moe().save_pretrained(path)
        write_fp8_moe(pathlib.Path(path) / "blocks")
        runs = ((None, path), ("fp8", path), ("blocks", os.path.join(path, "blocks", "fp8")))
        for quant, where in runs:
            for tp in (1, 2):
                llm = LLM(
                    where,
                    skip_tokenizer_init=True,
                    tensor_parallel_size=tp,
                    quantization=quant and "fp8",
                    **TINY_ENGINE,
                )
                res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
                out[f"{quant}-{tp}"] = [
                    (c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
                    for c in (r.outputs[0] for r in res)
                ]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def result():
    flags = " ".join(
        filter(None, (os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"))
    )
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join((ROOT, os.path.join(ROOT, "tests"))),
        XLA_FLAGS=flags,
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        cwd=ROOT,
        text=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quant", ["None", "fp8", "blocks"])
def test_tp2_equals_one_device(result, quant):
    one, two = result[f"{quant}-1"], result[f"{quant}-2"]
    assert len(one) == len(PROMPTS)
    for (toks1, lps1), (toks2, lps2) in zip(one, two):
        assert toks2 == toks1 and len(toks1) == 8
        assert max(abs(a - b) for a, b in zip(lps1, lps2)) <= TOL


if __name__ == "__main__":
    main()
