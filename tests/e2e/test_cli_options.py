"""The CLI's options reach `LLM`: engine options as `EngineConfig` fields, ``--kernels`` as a
`KernelConfig` (and its help text from it), vLLM's options, the defaults the CLI picks."""

import pytest

from .cli_runs import llm_kwargs, run_main


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


def test_vllm_flags_with_no_effect_reach_llm_only_when_given(monkeypatch, capsys):
    """A copied ``vllm serve`` command line runs: its no-effect flags parse and reach `LLM`
    (which warns where the value is not vLLM's default); flags not given are not passed."""
    kw = llm_kwargs(
        monkeypatch,
        capsys,
        "--trust-remote-code",
        "--no-enable-chunked-prefill",
        "--swap-space",
        "8",
    )
    assert (kw["trust_remote_code"], kw["enable_chunked_prefill"], kw["swap_space"]) == (
        True,
        False,
        8.0,
    )
    assert not {"disable_log_stats", "tokenizer_mode", "max_cpu_loras"} & set(kw)


def test_vllm_flags_with_no_effect_are_vllm_no_effect_arguments():
    from jaxinfer.cli_args import NO_EFFECT_OPTIONS
    from jaxinfer.config.vllm_args import VLLM_NO_EFFECT

    assert set(NO_EFFECT_OPTIONS) <= set(VLLM_NO_EFFECT)
