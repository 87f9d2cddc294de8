"""Acceptance 7 and 8 for the CLI: the default model answers; bad input is one line, exit 2."""

import csv
import json
import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
MEMORY_TRACE = os.path.join(
    os.path.dirname(__file__), "..", "..", "scripts", "probes", "memory_trace.py"
)  # generate's CLI with a memory trace


def run_cli(*args, timeout=600, cmd=("-m", "jaxinfer.generate")):
    return subprocess.run(
        [sys.executable, *cmd, *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def run_main(capsys, *args):
    """``python -m jaxinfer.generate ARGS`` in this process: (exit code, stdout, stderr)."""
    from jaxinfer import generate

    try:
        code = generate.main(list(args))
    except SystemExit as e:  # argparse errors exit from inside parse_args
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def shared_llm(monkeypatch, tiny):
    """The CLI in this process gets the shared tiny `LLM` (max_model_len 512, its
    character-level tokenizer) instead of loading one: these tests are about the CLI's mechanics."""
    import jaxinfer.llm

    monkeypatch.setattr(jaxinfer.llm, "LLM", lambda *a, **k: tiny)
    return tiny


def test_json_prompts_file_and_bad_prompt_in_batch(shared_llm, capsys, tmp_path):
    """--json, a .jsonl prompts file with an empty prompt: the good one still answers, the bad one
    is one error line, exit 2 (in this process on the shared LLM; the ``python -m`` run below
    loads the default model)."""
    f = tmp_path / "prompts.jsonl"
    f.write_text(
        json.dumps({"prompt": "What is the capital of France?"}) + "\n" + json.dumps("") + "\n"
    )
    code, out, err = run_main(capsys, "--prompts-file", str(f), "--max-tokens", "16", "--json")
    assert code == 2, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["index"] == 0
    # the raw prompt (no chat template) continues the text; the --chat run below checks the answer
    assert rows[0]["token_ids"]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "prompt 1" in errors[0] and "0 tokens" in errors[0]
    assert "Traceback" not in err


def test_default_model_chat_stream_answers_paris(tmp_path, smollm_cli_args):
    trace = tmp_path / "mem.csv"
    r = run_cli(
        str(trace),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--stream",
        *smollm_cli_args,
        cmd=[MEMORY_TRACE],
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "generated tokens:" in r.stderr and "TTFT" in r.stderr and "TTFT" not in r.stdout
    # the probe's memory trace: a header, one row before generation and one per step; pages used
    rows = list(csv.DictReader(trace.open()))
    assert len(rows) >= 3
    assert int(rows[0]["pages_in_use"]) == 0
    assert max(int(r["pages_in_use"]) for r in rows) >= 2  # chat prompt + answer span > 1 page
    assert int(rows[1]["weights_bytes"]) > 100e6 and int(rows[1]["kv_pool_bytes"]) > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--top-k", "-2"], "top_k"),
        (
            ["--prompt", "hi", "--model", "Qwen/Qwen3-8B"],  # a hub id: the local forms named
            "model 'Qwen/Qwen3-8B' is no local path (nothing is downloaded); give an HF model",
        ),
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
        (
            ["--prompt", "hi", "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8"],
            "tensor_parallel_size=2 is invalid: kv_cache_dtype='fp8' runs on one device only",
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


def test_n_samples_and_logprobs(shared_llm, capsys):
    """--n 2 --logprobs 2: per sample a ``--- [i] 'prompt' sample j`` line, its text, then one line
    per token: the token (repr), its log-probability and ``top:`` the 2 likeliest; --json: one
    object per sample with "logprobs" per token. Seeded, so both formats carry the same samples.
    The request is test_engine_door.py's (`PARAMS`): no step shape to compile for it."""
    args = (
        "--prompt",
        "the door of the engine",
        "--max-tokens",
        "9",
        "--n",
        "2",
        "--seed",
        "7",
        "--temperature",
        "0.8",
        "--ignore-eos",
        "--logprobs",
        "2",
    )
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1)]
    for r in rows:
        assert len(r["logprobs"]) == len(r["token_ids"]) == 9
        for e in r["logprobs"]:
            tops = [lp for _, lp in e["top"]]
            assert len(tops) == 2 and tops == sorted(tops, reverse=True) and e["logprob"] <= 0
            assert e["logprob"] <= tops[0] + 1e-6
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    lines = out.splitlines()
    for j, r in enumerate(rows):
        at = lines.index(f"--- [0] 'the door of the engine' sample {j}") + 1
        text = r["text"].split("\n")  # the text may hold newlines
        assert lines[at : at + len(text)] == text
        for line, e in zip(lines[at + len(text) :][:9], r["logprobs"], strict=True):
            assert line == f"  {e['token']!r} {e['logprob']:.4f}  top: " + ", ".join(
                f"{t!r} {lp:.4f}" for t, lp in e["top"]
            )
    assert "generated tokens: 18" in err


def test_kernels_help_lists_keys_and_values_from_kernel_config(capsys, monkeypatch):
    from jaxinfer.config import KernelConfig, kernel_choices

    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps help text at $COLUMNS
    code, help_text, _ = run_main(capsys, "--help")
    assert code == 0
    assert "--kernels SPEC" in help_text and "decode=mosaic,prefill=triton" in help_text
    for values in kernel_choices().values():
        assert "|".join(values) in help_text
    for old in (
        "--attention",
        "--prefill-attention",
        "--qkv-prologue",
        "--add-rms-norm",
        "--prefill-gemm",
        "--cublas-decode-min-batch",
    ):
        assert old not in help_text
    assert KernelConfig.help().split(";")[0] in help_text


def llm_kwargs(monkeypatch, capsys, *args) -> dict:
    """The keyword arguments ``python -m jaxinfer.generate ARGS`` hands to `LLM`."""
    import jaxinfer.llm

    class Seen(Exception):
        pass

    def fake_llm(*_args, **kwargs):
        raise Seen(kwargs)

    monkeypatch.setattr(jaxinfer.llm, "LLM", fake_llm)
    with pytest.raises(Seen) as e:
        run_main(capsys, "--prompt", "hi", *args)
    return e.value.args[0]


def test_kernels_and_engine_options_reach_llm(monkeypatch, capsys):
    """``--kernels SPEC`` is handed to `LLM` as a parsed `KernelConfig`; the engine options as
    `EngineConfig` fields."""
    from jaxinfer.config import KernelConfig

    kw = llm_kwargs(
        monkeypatch,
        capsys,
        "--kernels",
        "decode=reference,batch_buckets=1:64",
        "--max-model-len",
        "128",
        "--memory-fraction",
        "0.5",
        "--num-pages",
        "40",
        "--dtype",
        "bfloat16",
        "--compilation-cache-dir",
        "/tmp/x",
    )
    assert kw["kernels"] == KernelConfig(decode_attention="reference", batch_buckets=(1, 64))
    assert (
        kw["max_model_len"],
        kw["memory_fraction"],
        kw["num_pages"],
        kw["dtype"],
        kw["compilation_cache_dir"],
        kw["page_size"],
    ) == (128, 0.5, 40, "bfloat16", "/tmp/x", 16)
    assert "seed" not in kw  # --seed is the requests' seed


@pytest.mark.parametrize(
    "args, expected", [((), 1), (("--n", "3", "--prompt", "b"), 6), (("--max-num-seqs", "5"), 5)]
)
def test_max_num_seqs_defaults_to_the_samples_asked(monkeypatch, capsys, args, expected):
    """Unset, ``--max-num-seqs`` is the number of samples asked (prompts x n, at most
    `EngineConfig`'s 64), so the KV pool a CPU run allocates and zeroes fits the run."""
    assert llm_kwargs(monkeypatch, capsys, *args)["max_num_seqs"] == expected


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


@pytest.mark.parametrize(
    "flag,expected",
    [((), True), (("--async-scheduling",), True), (("--no-async-scheduling",), False)],
)
def test_async_scheduling_flag_reaches_the_engine(monkeypatch, capsys, flag, expected):
    """--[no-]async-scheduling is handed to `LLM` (default on). That both modes give the same
    tokens, finish reasons and free pages is checked on the engine itself, with stop strings and
    preemption (`tests/e2e/test_async_scheduling.py`); this keeps the CLI's wiring honest without
    two more model runs."""
    assert llm_kwargs(monkeypatch, capsys, *flag)["async_scheduling"] is expected


def test_stream_with_stop_string_prints_no_empty_deltas(shared_llm, capsys):
    """Text held back while it may begin a stop string is not streamed as an empty ``[i]`` line."""
    # a 40-character stop string holds back the first tokens' text until the request finishes
    code, out, err = run_main(
        capsys,
        "--prompt",
        "The capital of France is",
        "--prompt",
        "List three colours:",
        "--max-tokens",
        "6",
        "--stream",
        "--stop",
        "z" * 40,
    )
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert lines, out
    assert all(ln.split("] ", 1)[1] if "] " in ln else "" for ln in lines), lines


def test_prompts_file_lines_end_only_at_newline(tmp_path):
    """U+2028, U+0085, form feed, vertical tab and a lone \\r stay inside a prompt (not
    str.splitlines); \\r\\n ends a line; a .jsonl line holding U+2028 is one valid JSON string."""
    from jaxinfer.generate import _read_prompts_file

    f = tmp_path / "p.txt"
    f.write_bytes("a\u2028b\x0cc\r\nd\x0be\x85f\rg\n\n".encode())
    assert _read_prompts_file(str(f)) == ["a\u2028b\x0cc", "d\x0be\x85f\rg"]
    j = tmp_path / "p.jsonl"
    j.write_text(
        json.dumps({"prompt": "x\u2028y"}, ensure_ascii=False)
        + "\r\n"
        + json.dumps("z\x0c")
        + "\n",
        encoding="utf-8",
    )
    assert _read_prompts_file(str(j)) == ["x\u2028y", "z\x0c"]


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


def test_vllm_options_reach_llm(monkeypatch, capsys):
    kw = llm_kwargs(
        monkeypatch,
        capsys,
        "--gpu-memory-utilization",
        "0.8",
        "--dtype",
        "auto",
        "--tokenizer",
        "/tok",
        "--enforce-eager",
        "--tensor-parallel-size",
        "2",
        "--kv-cache-dtype",
        "auto",
        "--no-enable-prefix-caching",
        "--quantization",
        "fp8",
    )
    assert (
        kw["gpu_memory_utilization"],
        kw["dtype"],
        kw["tokenizer"],
        kw["enforce_eager"],
        kw["tensor_parallel_size"],
        kw["kv_cache_dtype"],
        kw["enable_prefix_caching"],
        kw["quantization"],
    ) == (0.8, "auto", "/tok", True, 2, "auto", False, "fp8")
