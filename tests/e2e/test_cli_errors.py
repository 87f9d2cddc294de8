"""Acceptance 8 for the CLI: bad input is one line on stderr and exit code 2 (arguments, models,
prompts, prompts files), and a bad prompt does not stop the others."""

import json
import os

import pytest

from .cli_runs import run_cli, run_main


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--top-k", "-2"], "top_k"),
        (
            ["--prompt", "hi", "--model", "jaxinfer-tests/none"],  # a hub id not in the HF cache
            "model 'jaxinfer-tests/none' is no local path, and Hugging Face hub id "
            "'jaxinfer-tests/none' could not be resolved (HF_HUB_OFFLINE=1",
        ),
        (["--prompt", "hi", "--model", "no/such/dir"], "not a Hugging Face hub id"),
        (["--max-tokens", "4"], "no prompt"),
        (["--prompt", "hi", "--n", "0"], "n=0 is invalid: must be an integer >= 1"),
        (["--prompt", "hi", "--n", "two"], "argument --n: invalid int value: 'two'"),
        (
            ["--prompt", "hi", "--logprobs", "21"],
            "logprobs=21 is invalid: must be None or an integer in [0, 20]",
        ),
        (["--prompt", "hi", "--logprobs", "-1"], "logprobs=-1 is invalid"),
        (["--prompt", "hi", "--stream", "--n", "2"], "--n above 1"),
        (["--prompt", "hi", "--stream", "--logprobs", "0"], "cannot be combined with --json, --n"),
        (["--prompt", "hi", "--max-tokens", "many"], "max-tokens"),
        (
            ["--prompt", "hi", "--kernels", "qkv_prologue=triton"],
            "'qkv_prologue=triton' is invalid",
        ),
        (
            ["--prompt", "hi", "--kernels", "decode=mosaic"],
            "decode_attention='mosaic' is a GPU kernel",
        ),
        (
            ["--prompt", "hi", "--kernels", "prefill=triton"],
            "prefill_attention='triton' is a GPU kernel",
        ),
        (
            ["--prompt", "hi", "--kernels", "decode=fast"],
            "decode_attention='fast' is invalid: allowed: 'auto', 'reference', 'mosaic'",
        ),
        (["--prompt", "hi", "--kernels", "prefill_gemm=cudnn"], "prefill_gemm='cudnn'"),
        (["--prompt", "hi", "--kernels", "cublas_decode_min_batch=0"], "cublas_decode_min_batch"),
        (["--prompt", "hi", "--kernels", "attention=mosaic"], "'attention=mosaic' is invalid"),
        (["--prompt", "hi", "--tensor-parallel-size", "0"], "tensor_parallel_size=0 is invalid"),
        (
            ["--prompt", "hi", "--speculative-config", "{method: ngram}"],
            "argument --speculative-config: speculative_config='{method: ngram}' is not valid JSON",
        ),
        (
            [
                "--prompt",
                "hi",
                "--tensor-parallel-size",
                "2",
            ],  # SmolLM2's 9 heads: config read only
            "num_heads=9 is not divisible by tensor_parallel_size=2",
        ),
        (
            ["--prompt", "hi", "--tensor-parallel-size", "3"],  # divides 9 heads; one CPU device
            "tensor_parallel_size=3 is invalid: JAX sees 1 cpu device(s)",
        ),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, args, needle):
    """Checked in this process (no model is loaded for any of them); `test_unsupported_architecture`
    and the runs below check the same one-line contract through ``python -m``."""
    code, _out, err = run_main(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("chat", [(), ("--chat",)])
def test_empty_prompts_fail_before_the_model_loads(monkeypatch, capsys, tmp_path, chat):
    """Prompts that are all empty, plain or to be wrapped in the chat template, are one error
    line and exit 2 before the model loads: the missing --model is never reached (its error
    would name the model) and no `LLM` is built; empty lines of a .jsonl file the same."""
    import jaxinfer.llm

    def no_llm(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the prompts were checked")

    monkeypatch.setattr(jaxinfer.llm, "LLM", no_llm)
    missing = str(tmp_path / "no-such-model")
    code, out, err = run_main(capsys, "--model", missing, *chat, "--prompt", "")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "error: prompt 0 is empty: every prompt needs text (with --chat too)"
    ], err
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps("") + "\n" + json.dumps("") + "\n")
    code, out, err = run_main(capsys, "--model", missing, *chat, "--prompts-file", str(f))
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "error: prompts 0, 1 are empty: every prompt needs text (with --chat too)"
    ], err


@pytest.mark.parametrize("chat", [(), ("--chat",)])
def test_an_empty_prompt_among_others_is_refused_and_the_others_run(shared_llm, capsys, chat):
    """One empty prompt among valid ones: its error line, the others' answers, exit 2, with or
    without the chat template (which once turned an empty prompt into 64 tokens)."""
    args = (*chat, "--prompt", "Hi", "--prompt", "", "--max-tokens", "3", "--json")
    code, out, err = run_main(capsys, *args)
    assert code == 2
    assert "error: prompt 1 is empty: every prompt needs text (with --chat too)" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == [0] and len(rows[0]["token_ids"]) == 3


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10})
    )
    r = run_cli("--prompt", "hi", "--model", str(tmp_path), timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "gpt2" in lines[0] and "llama" in lines[0], r.stderr


def test_prompt_longer_than_max_model_len(shared_llm, capsys):
    code, _out, err = run_main(capsys, "--prompt", "word " * 600, "--max-tokens", "4")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(shared_llm.engine.max_model_len) in lines[0], err


def test_undecodable_prompt_bytes_and_bad_prompts_file(shared_llm, capsys, tmp_path):
    """Undecodable argv bytes: one error line for that prompt, the other prompt still answers.
    A prompts file that is not UTF-8 is a one-line error naming the file."""
    bad = os.fsdecode(b"bad \xff\xfe")  # what Python makes of undecodable argv bytes
    code, out, err = run_main(
        capsys, "--prompt", bad, "--prompt", "The capital of France is", "--max-tokens", "4"
    )
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")][0].startswith(
        "error: prompt 0: prompt is not valid Unicode"
    )
    assert "--- [1]" in out
    f = tmp_path / "p.txt"
    f.write_bytes(b"ok\n\xff bad\n")
    code, _out, err = run_main(capsys, "--prompts-file", str(f))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not UTF-8" in err and "p.txt" in err


@pytest.mark.parametrize("size", [24, 100, 1000, 5000, 200_000])
def test_truncated_gguf_is_one_line_exit_2(capsys, tmp_path, smollm_path, size):
    """A GGUF cut anywhere in its header or metadata: one error line naming the file, exit 2."""
    bad = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as f:
        bad.write_bytes(f.read(size))
    code, _out, err = run_main(capsys, "--model", str(bad), "--prompt", "hi")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "cut.gguf" in lines[0], err
    assert "not a readable GGUF file" in lines[0]
