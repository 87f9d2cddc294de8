"""`KernelConfig`: the kernel knobs (attention variants, GEMM back-ends, step-shape buckets), their
allowed values (`kernel_choices`) and `check_platform`. No JAX."""

from __future__ import annotations  # the field types stay strings: `_check` and cli_args read them

import dataclasses

from jaxinfer.checks import is_int
from jaxinfer.config.model import _check, _fail
from pallas_kernels.paged_attention import registry

KERNEL_ALIASES = {"decode": "decode_attention", "prefill": "prefill_attention"}
_BUCKETS = ("batch_buckets", "token_buckets")
_NUMBERS = {  # `KernelConfig.parse`'s message for a value that is not a number
    "cublas_decode_min_batch": "expected 'none' or a positive integer",
    "ragged_decode_max_tokens": "expected 'none' or an integer >= 0",
}


def kernel_choices() -> dict[str, tuple[str, ...]]:
    """Allowed values of each string field of `KernelConfig` (attention: the kernel registry)."""
    return {
        "decode_attention": ("auto", *registry.DECODE),
        "prefill_attention": ("auto", *registry.PREFILL),
        "prefill_gemm": ("xla", "cublas"),
        "fp8_gemm": ("w8a16", "w8a8"),
        "fp8_act_quant": ("xla", "fused"),
        "moe_gemm": ("auto", "ragged_dot", "triton", "mixed"),
    }


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Kernel knobs (allowed: `kernel_choices`; `resolve` replaces "auto"): paged attention of
    decode (T == 1) / prefill steps; prefill_gemm (cublas: GPU); fp8_gemm: fp8 weights' GEMM,
    w8a16 (activations in the compute dtype) or w8a8 (per-token e4m3 activations, per-channel
    weight scales only; not yet timed on a GPU); fp8_act_quant: where W8A8 quantises a GEMM's
    input per token, XLA's ops before the GEMM or (GPU) "fused" into the op producing it
    (`pallas_kernels.act_quant`; `resolve` keeps "fused" where W8A8 runs on one device without
    LoRA); decode buckets of >=
    cublas_decode_min_batch rows use cuBLAS (None: XLA); verify steps (speculative decoding) of
    at most ragged_decode_max_tokens tokens attend each token as a decode row (0: never; None: 32
    with a GPU decode kernel, 0 with the reference; BENCHMARKS "Issue 45"); moe_gemm: the
    experts' grouped GEMM of mixture-of-experts layers, XLA's ``jax.lax.ragged_dot``, the
    Pallas/Triton kernel `pallas_kernels.moe_gemm` (GPU) or "mixed" (GPU: the kernel for steps of
    at most `models.kernels.MIXED_TRITON_MAX_ROWS` routed rows, ragged_dot above; "auto" on a
    GPU); batch_buckets / token_buckets: B / T."""

    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    prefill_gemm: str = "xla"
    fp8_gemm: str = "w8a16"
    fp8_act_quant: str = "xla"
    moe_gemm: str = "auto"
    cublas_decode_min_batch: int | None = 64
    ragged_decode_max_tokens: int | None = None
    batch_buckets: tuple[int, ...] = ()
    token_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(
            self,
            (
                *(
                    (name, allowed.__contains__, "allowed: " + ", ".join(map(repr, allowed)))
                    for name, allowed in kernel_choices().items()
                ),
                (
                    "cublas_decode_min_batch",
                    lambda m: m is None or is_int(m, 1),
                    "must be None or a positive integer",
                ),
                (
                    "ragged_decode_max_tokens",
                    lambda m: m is None or is_int(m, 0),
                    "must be None or an integer >= 0",
                ),
                *(
                    (
                        name,
                        lambda b: (
                            isinstance(b, (tuple, list))
                            and all(is_int(x, 1) for x in b)
                            and list(b) == sorted(set(b))
                        ),
                        "must be a tuple of strictly increasing positive integers, "
                        "or () for the defaults",
                    )
                    for name in _BUCKETS
                ),
            ),
        )
        for name in _BUCKETS:
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def parse(cls, spec: str | KernelConfig) -> KernelConfig:
        """From ``"key=value,..."`` (e.g. ``"decode=mosaic,batch_buckets=1:2:4"``; keys: fields or
        `KERNEL_ALIASES`), or a `KernelConfig`. ValueError: no ``=``, bad/repeated key or value."""
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, str):
            raise ValueError(
                f"kernels={spec!r} is invalid: expected a KernelConfig or a 'key=value,...' string"
            )
        keys, kw = {f.name for f in dataclasses.fields(cls)}, {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            name = KERNEL_ALIASES.get(key, key)
            if not sep or name not in keys:
                raise ValueError(
                    f"kernels: {item!r} is invalid: expected key=value with key one "
                    f"of {sorted(keys | set(KERNEL_ALIASES))}"
                )
            if name in kw:
                raise ValueError(f"kernels: {name!r} is given twice in {spec!r}")
            try:
                kw[name] = (
                    (tuple(int(x) for x in value.split(":")) if value else ())
                    if name in _BUCKETS
                    else value
                    if name in kernel_choices()
                    else None
                    if value.lower() == "none"
                    else int(value)
                )
            except ValueError:
                what = _NUMBERS.get(name, "expected positive integers joined by ':' (e.g. 1:2:4)")
                _fail("KernelConfig", name, value, what)
        return cls(**kw)

    @classmethod
    def help(cls) -> str:
        """The keys with their allowed values and defaults, for CLI help texts."""
        alias, choices = {v: k for k, v in KERNEL_ALIASES.items()}, kernel_choices()
        return "; ".join(
            f"{alias.get(f.name, f.name)}="
            + (
                "|".join(choices[f.name])
                if f.name in choices
                else "sizes joined by ':'"
                if f.name in _BUCKETS
                else "none|N"
            )
            + (f" (default {f.default})" if f.default != () else " (default empty: engine's)")
            for f in dataclasses.fields(cls)
        )


GPU_FREE = ("auto", "reference", "ragged_dot", "xla")  # the values of the kernel keys a CPU runs


def check_platform(kc: KernelConfig, platform: str) -> None:
    """Raise ValueError when ``kc`` names a GPU kernel and ``platform`` is not "gpu" (the message
    lists that key's values a CPU runs)."""
    for name in (*KERNEL_ALIASES.values(), "moe_gemm", "fp8_act_quant"):
        if platform != "gpu" and (value := getattr(kc, name)) not in GPU_FREE:
            ok = tuple(v for v in kernel_choices()[name] if v in GPU_FREE)
            alias = {v: k for k, v in KERNEL_ALIASES.items()}.get(name)
            raise ValueError(
                f"KernelConfig.{name}={value!r} is a GPU kernel"
                + (f" (kernels key {alias!r} or {name!r})" if alias else "")
                + f" and this host's JAX backend is {platform!r}; use "
                f"{' or '.join(map(repr, ok))} here (the kernels' CPU tests run them in "
                "interpret mode)"
            )
