"""KernelConfig (parse, validation, help), EngineConfig and resolve: the rules for "auto" and
platform defaults, with the platform passed explicitly (no GPU needed)."""

import dataclasses

import pytest

from jaxinfer.config import EngineConfig, KernelConfig, ModelConfig, kernel_choices, resolve
from pallas_kernels.paged_attention import registry


def model(hidden=4096, head_dim=128, max_pos=4096):
    return ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
    )


def test_parse_keys_aliases_and_values():
    kc = KernelConfig.parse(
        "decode=mosaic, prefill=triton,batch_buckets=1:2:4:8,"
        "token_buckets=16:64,cublas_decode_min_batch=none,prefill_gemm=cublas"
    )
    assert kc == KernelConfig(
        decode_attention="mosaic",
        prefill_attention="triton",
        batch_buckets=(1, 2, 4, 8),
        token_buckets=(16, 64),
        cublas_decode_min_batch=None,
        prefill_gemm="cublas",
    )
    assert KernelConfig.parse("decode_attention=triton") == KernelConfig(decode_attention="triton")
    assert KernelConfig.parse("") == KernelConfig()
    assert KernelConfig.parse("cublas_decode_min_batch=8").cublas_decode_min_batch == 8
    assert KernelConfig.parse(kc) is kc


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("decode=foo", ["decode_attention='foo'", "'mosaic'", "'reference'"]),
        ("prefill=flash", ["prefill_attention='flash'", "'triton'", "'mosaic'"]),
        ("qkv_prologue=triton", ["'qkv_prologue=triton'", "decode_attention", "prefill"]),
        ("prefill_gemm=cutlass", ["prefill_gemm='cutlass'", "allowed: 'xla', 'cublas'"]),
        ("fp8_act_quant=triton", ["fp8_act_quant='triton'", "allowed: 'xla', 'fused'"]),
        ("speed=fast", ["'speed=fast'", "decode_attention", "prefill"]),
        ("decode", ["'decode'", "key=value"]),
        ("decode=mosaic,decode_attention=triton", ["'decode_attention' is given twice"]),
        ("batch_buckets=1:x", ["batch_buckets='1:x'", "integers"]),
        ("batch_buckets=4:2", ["batch_buckets=(4, 2)", "strictly increasing"]),
        ("cublas_decode_min_batch=0", ["cublas_decode_min_batch=0", "positive integer"]),
        (
            "cublas_decode_min_batch=many",
            ["cublas_decode_min_batch='many'", "'none' or a positive"],
        ),
        (
            "ragged_decode_max_tokens=abc",
            ["ragged_decode_max_tokens='abc'", "expected 'none' or an integer >= 0"],
        ),
    ],
)
def test_parse_errors_name_the_key_value_and_allowed(spec, needles):
    with pytest.raises(ValueError) as e:
        KernelConfig.parse(spec)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_allowed_names_come_from_the_registry_and_reach_the_help():
    assert kernel_choices()["decode_attention"] == ("auto",) + tuple(registry.DECODE)
    assert kernel_choices()["prefill_attention"] == ("auto",) + tuple(registry.PREFILL)
    text = KernelConfig.help()
    for f in dataclasses.fields(KernelConfig):
        assert f.name in text or f.name in ("decode_attention", "prefill_attention")
    assert "decode=" + "|".join(kernel_choices()["decode_attention"]) in text
    assert "prefill=" + "|".join(kernel_choices()["prefill_attention"]) in text


def test_engine_config_kernels_from_a_string_and_bucket_limits():
    assert EngineConfig(kernels="decode=reference").kernels == KernelConfig(
        decode_attention="reference"
    )
    with pytest.raises(ValueError, match=r"kernels=3 is invalid"):
        EngineConfig(kernels=3)
    with pytest.raises(ValueError, match="batch_buckets.*max_num_seqs=8"):
        EngineConfig(kernels=KernelConfig(batch_buckets=(1, 2)), max_num_seqs=8)
    with pytest.raises(ValueError, match="token_buckets.*max_num_batched_tokens=64"):
        EngineConfig(kernels="token_buckets=16:32", max_num_batched_tokens=64)
    assert EngineConfig(kernels="batch_buckets=1:8", max_num_seqs=8).kernels.batch_buckets == (1, 8)


def test_buckets_must_be_a_tuple_of_ints():
    """A bare int, None or a bool entry is a clear ValueError naming the field, not a TypeError
    from inside the check or a bucket of True."""
    for bad in (256, None, (True, 256)):
        with pytest.raises(ValueError, match=r"KernelConfig\.batch_buckets=.* is invalid"):
            KernelConfig(batch_buckets=bad)
    with pytest.raises(ValueError, match=r"KernelConfig\.token_buckets=.* is invalid"):
        KernelConfig(token_buckets=4096)
    assert KernelConfig(batch_buckets=[1, 8]).batch_buckets == (1, 8)


@pytest.mark.parametrize(
    "field, bad",
    [
        ("page_size", 12),
        ("num_pages", 1),
        ("dtype", "int8"),
        ("memory_fraction", 0.0),
        ("max_num_seqs", 0),
        ("async_scheduling", 1),
        ("seed", 1.5),
    ],
)
def test_engine_config_validation_names_the_field(field, bad):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}={bad!r} is invalid"):
        EngineConfig(**{field: bad})


@pytest.mark.parametrize(
    "field",
    [
        "memory_fraction",
        "gpu_memory_utilization",
        "max_model_len",
        "page_size",
        "num_pages",
        "max_num_seqs",
        "max_num_batched_tokens",
        "tensor_parallel_size",
    ],
)
def test_engine_config_numbers_given_as_strings_are_value_errors(field):
    """A number as a string (e.g. from a config file) is a ValueError naming the field, never a
    TypeError from a comparison."""
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}='0\.5' is invalid"):
        EngineConfig(**{field: "0.5"})


def test_engine_config_vllm_arguments():
    assert EngineConfig(dtype="auto").dtype is None  # resolve: bfloat16 on GPU, else float32
    e = EngineConfig(gpu_memory_utilization=0.5, enforce_eager=True, kv_cache_dtype="auto")
    assert (e.gpu_memory_utilization, e.enforce_eager, e.tensor_parallel_size) == (0.5, True, 1)
    for kw in (
        dict(tensor_parallel_size=0),
        dict(kv_cache_dtype="fp16"),
        dict(enforce_eager=1),
        dict(gpu_memory_utilization=0.0),
    ):
        with pytest.raises(ValueError, match=rf"EngineConfig\.{next(iter(kw))}="):
            EngineConfig(**kw)


def test_resolve_defaults_per_platform_and_dtype():
    r = resolve(model(), EngineConfig(), "cpu")
    assert (r.dtype, r.max_model_len, r.platform, r.dtype_bytes) == ("float32", 4096, "cpu", 4)
    cpu = KernelConfig("reference", "reference", moe_gemm="ragged_dot", ragged_decode_max_tokens=0)
    assert r.kernels == cpu
    g = resolve(model(), EngineConfig(), "gpu")
    assert g.dtype == "bfloat16"
    assert g.kernels == KernelConfig(
        "mosaic", "triton", moe_gemm="mixed", ragged_decode_max_tokens=32
    )
    f32 = resolve(model(), EngineConfig(dtype="float32"), "gpu").kernels
    assert (f32.decode_attention, f32.prefill_attention) == ("reference", "triton")
    assert f32.ragged_decode_max_tokens == 0  # token by token needs a decode kernel
    # explicit choices are kept
    kc = KernelConfig("triton", "reference", moe_gemm="triton", ragged_decode_max_tokens=8)
    assert resolve(model(), EngineConfig(kernels=kc), "gpu").kernels == kc


def test_kv_cache_dtype_fp8():
    """'fp8' and vLLM's 'fp8_e4m3' give float8_e4m3fn pools of 1 byte; "auto" decode is triton
    on the GPU (mosaic is not validated on fp8 pages, and an explicit mosaic is an error)."""
    for name in ("fp8", "fp8_e4m3"):
        r = resolve(model(), EngineConfig(kv_cache_dtype=name), "cpu")
        assert (r.dtype, r.kv_dtype, r.kv_dtype_bytes, r.dtype_bytes) == (
            "float32",
            "float8_e4m3fn",
            1,
            4,
        )
    auto = resolve(model(), EngineConfig(dtype="bfloat16"), "cpu")
    assert (auto.kv_dtype, auto.kv_dtype_bytes) == ("bfloat16", 2)
    g = resolve(model(), EngineConfig(kv_cache_dtype="fp8"), "gpu").kernels
    assert (g.decode_attention, g.prefill_attention) == ("triton", "triton")
    with pytest.raises(ValueError, match="decode_attention='mosaic' is not validated with fp8 KV"):
        resolve(model(), EngineConfig(kv_cache_dtype="fp8", kernels="decode=mosaic"), "gpu")
    with pytest.raises(
        ValueError, match="kv_cache_dtype='int8' is invalid: allowed: 'auto'.*'fp8' or 'fp8_e4m3'"
    ):
        EngineConfig(kv_cache_dtype="int8")


def test_resolve_max_model_len():
    assert resolve(model(max_pos=512), EngineConfig(max_model_len=128), "cpu").max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len=1024.*max_position_embeddings=512"):
        resolve(model(max_pos=512), EngineConfig(max_model_len=1024), "cpu")


@pytest.mark.parametrize(
    "spec, field, cpu_ok",
    [
        ("decode=mosaic", "decode_attention", "'auto' or 'reference'"),
        ("decode=triton", "decode_attention", "'auto' or 'reference'"),
        ("prefill=triton", "prefill_attention", "'auto' or 'reference'"),
        ("moe_gemm=triton", "moe_gemm", "'ragged_dot' here"),
        ("fp8_act_quant=fused", "fp8_act_quant", "'xla' here"),
    ],
)
def test_gpu_kernels_on_cpu_are_rejected(spec, field, cpu_ok):
    """A GPU kernel off the GPU is refused, naming the values of that key a CPU runs and, for an
    aliased key, the alias the user may have typed (``prefill``)."""
    value = spec.split("=")[1]
    with pytest.raises(
        ValueError, match=f"{field}='{value}' is a GPU kernel.*'cpu'.*{cpu_ok}"
    ) as e:
        resolve(model(), EngineConfig(kernels=spec), "cpu")
    key = spec.split("=")[0]
    assert (f"(kernels key '{key}' or '{field}')" in str(e.value)) == (key != field), str(e.value)
    resolve(model(), EngineConfig(kernels=spec), "gpu")  # accepted there


def test_unvalidated_device_kind_falls_back_from_mosaic_with_one_log_line(caplog):
    """A faked Blackwell (sm_100) GPU: "auto" decode leaves Mosaic GPU (written for sm_90a) for
    the Triton variant and says so once; validated kinds and explicit choices are kept."""
    assert "NVIDIA B200" not in registry.VALIDATED["mosaic"]
    with caplog.at_level("WARNING", logger="jaxinfer"):
        b200 = resolve(model(), EngineConfig(), "gpu", device_kind="NVIDIA B200").kernels
    assert (b200.decode_attention, b200.prefill_attention) == ("triton", "triton")
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxinfer"]
    assert (
        len(lines) == 1
        and "decode_attention='mosaic'" in lines[0]
        and "'NVIDIA B200'" in lines[0]
        and "'triton'" in lines[0]
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxinfer"):
        h200 = resolve(model(), EngineConfig(), "gpu", device_kind="NVIDIA H200").kernels
        kept = resolve(
            model(), EngineConfig(kernels="decode=mosaic"), "gpu", device_kind="NVIDIA B200"
        ).kernels
        cpu = resolve(model(), EngineConfig(), "cpu", device_kind="cpu").kernels
    assert h200.decode_attention == "mosaic" and kept.decode_attention == "mosaic"
    assert cpu.decode_attention == "reference" and not caplog.records
    assert registry.for_device("reference", "NVIDIA B200") == "reference"


def test_w8a8_without_fp8_weights_is_logged_as_ignored(caplog):
    """``fp8_gemm="w8a8"`` only changes fp8 weights' GEMMs: without ``quantization="fp8"`` it is
    ignored, with one warning naming the flag to pass; with it, nothing is logged."""
    with caplog.at_level("WARNING", logger="jaxinfer"):
        resolve(model(), EngineConfig(kernels="fp8_gemm=w8a8"), "cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxinfer"]
    assert len(lines) == 1 and "fp8_gemm='w8a8'" in lines[0] and "quantization='fp8'" in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxinfer"):
        resolve(model(), EngineConfig(kernels="fp8_gemm=w8a8", quantization="fp8"), "cpu")
        resolve(model(), EngineConfig(), "cpu")
    assert not caplog.records


def test_fused_act_quant_resolves_where_w8a8_runs_else_xla_with_one_log_line(caplog):
    """``fp8_act_quant="fused"`` (GPU) is kept where W8A8 runs (fp8 weights with per-channel
    scales, fp8_gemm w8a8) on one device without LoRA, silently; elsewhere it resolves to "xla"
    with one warning saying why."""
    assert KernelConfig.parse("fp8_act_quant=fused").fp8_act_quant == "fused"
    assert (
        KernelConfig().fp8_act_quant == "xla" and "fp8_act_quant=xla|fused" in KernelConfig.help()
    )
    w8a8 = dict(quantization="fp8", kernels="fp8_gemm=w8a8,fp8_act_quant=fused")
    with caplog.at_level("WARNING", logger="jaxinfer"):
        assert resolve(model(), EngineConfig(**w8a8), "gpu").kernels.fp8_act_quant == "fused"
    assert not caplog.records
    block = dataclasses.replace(model(), weight_block_size=(128, 128))
    for m, kw, why in (
        (model(), dict(w8a8, quantization=None), "it needs W8A8"),
        (model(), dict(w8a8, kernels="fp8_act_quant=fused"), "it needs W8A8"),
        (block, w8a8, "block-scaled"),
        (model(), dict(w8a8, tensor_parallel_size=2), "tensor_parallel_size=2"),
        (model(), dict(w8a8, enable_lora=True), "LoRA"),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="jaxinfer"):
            assert resolve(m, EngineConfig(**kw), "gpu").kernels.fp8_act_quant == "xla"
        lines = [r.getMessage() for r in caplog.records if "fp8_act_quant" in r.getMessage()]
        assert len(lines) == 1 and why in lines[0], (kw, lines)


def test_quantization_resolves_from_the_checkpoint():
    assert resolve(model(), EngineConfig(), "cpu").quantization is None
    assert resolve(model(), EngineConfig(quantization="fp8"), "cpu").quantization == "fp8"
    fp8_ckpt = dataclasses.replace(model(), weight_block_size=[128, 128])
    assert fp8_ckpt.weight_block_size == (128, 128)
    assert resolve(fp8_ckpt, EngineConfig(), "cpu").quantization == "fp8"
    with pytest.raises(ValueError, match="ModelConfig.weight_block_size=.*invalid"):
        dataclasses.replace(model(), weight_block_size=(128,))


def test_fp8_with_tensor_parallelism():
    """fp8 weights split over devices, FP8 checkpoints' blocks where they fall whole into each
    device's share (else the error names the sizes); fp8 KV splits over devices too."""
    assert (
        resolve(
            model(), EngineConfig(tensor_parallel_size=2, quantization="fp8"), "cpu"
        ).quantization
        == "fp8"
    )
    fp8_ckpt = dataclasses.replace(model(), weight_block_size=(128, 128))  # F / 2 = 32 columns
    assert resolve(fp8_ckpt, EngineConfig(), "cpu").quantization == "fp8"
    with pytest.raises(
        ValueError,
        match=r"weight_block_size=\(128, 128\) and tensor_parallel_size"
        r"=2: each device needs whole FP8 blocks .*N\*H/tp=256, k, v columns "
        r"K'\*H/tp=128, gate, up columns and w_down rows F/tp=32",
    ):
        resolve(fp8_ckpt, EngineConfig(tensor_parallel_size=2), "cpu")
    fp8_kv = resolve(model(), EngineConfig(tensor_parallel_size=2, kv_cache_dtype="fp8"), "cpu")
    assert fp8_kv.kv_dtype == "float8_e4m3fn"


def test_smoothquant_resolves_where_w8a8_runs():
    """SmoothQuant's alpha: 0.4 by default where W8A8 runs (fp8 weights, fp8_gemm w8a8, one
    device, no LoRA), None elsewhere (W8A16: when asked); 0 is off; an alpha where it cannot
    apply, or out of [0, 1], is a ValueError naming the field."""
    w8a8 = dict(quantization="fp8", kernels="fp8_gemm=w8a8")
    assert resolve(model(), EngineConfig(**w8a8), "cpu").smoothquant == 0.4
    assert resolve(model(), EngineConfig(smoothquant=0.3, **w8a8), "cpu").smoothquant == 0.3
    assert resolve(model(), EngineConfig(smoothquant=0, **w8a8), "cpu").smoothquant is None
    w8a16 = EngineConfig(smoothquant=0.4, quantization="fp8")
    assert resolve(model(), w8a16, "cpu").smoothquant == 0.4
    tp2 = dict(**w8a8, tensor_parallel_size=2)
    for off in ({}, dict(quantization="fp8"), dict(**w8a8, enable_lora=True), tp2):
        assert resolve(model(), EngineConfig(**off), "cpu").smoothquant is None
    for bad, why in (
        ({}, "needs fp8 weights"),
        (dict(kernels="fp8_gemm=w8a8"), "needs fp8 weights"),
        (dict(**w8a8, enable_lora=True), "LoRA"),
        (tp2, "one device"),
    ):
        with pytest.raises(
            ValueError, match=rf"EngineConfig\.smoothquant=0\.5 is invalid: .*{why}"
        ):
            resolve(model(), EngineConfig(smoothquant=0.5, **bad), "cpu")
    block = dataclasses.replace(model(), weight_block_size=(128, 128))
    assert resolve(block, EngineConfig(**w8a8), "cpu").smoothquant is None
    with pytest.raises(ValueError, match="quantised already"):
        resolve(block, EngineConfig(smoothquant=0.5, **w8a8), "cpu")
    for bad in (1.5, -0.1, "0.5"):
        with pytest.raises(ValueError, match=rf"EngineConfig\.smoothquant={bad!r} is invalid"):
            EngineConfig(smoothquant=bad)
