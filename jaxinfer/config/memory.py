"""KV pool sizing (`kv_pool_pages`, the one formula; vLLM's ``gpu_memory_utilization``), bytes per
device under tensor parallelism; capacity plans: ``scripts/plan_memory.py``. Imports no JAX."""

import os

from jaxinfer.config import ResolvedConfig
from jaxinfer.config.model import ModelConfig, tp_model_config

GIB = 1 << 30
CPU_KV_BUDGET_BYTES = 2 * GIB  # KV pool cap where the device reports no memory stats (CPU)
USED_BYTES_STEP = GIB  # bytes in use rounded up: the same pool shape (cache keys) on each start


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """KV bytes per token one device holds: `ModelConfig.kv_bytes_per_token` of the K' =
    max(K, tp) KV heads (`tp_model_config`), divided by ``tp``."""
    return tp_model_config(cfg, tp).kv_bytes_per_token(dtype_bytes) // tp


def default_reserve_bytes(device_bytes: int) -> int:
    """Activation/workspace reserve: ``max(1 GiB, 5% of device_bytes)``."""
    return max(GIB, int(device_bytes * 0.05))


def kv_pool_pages(
    model: ModelConfig,
    *,
    page_size: int,
    dtype_bytes: int,
    usable_bytes: int,
    used_bytes: int,
    tp: int = 1,
    extra_bytes_per_token: int = 0,
) -> int:
    """THE KV pool sizing formula: pages (null page 0 included) of ``page_size`` tokens that fit
    in ``usable_bytes - used_bytes`` of one device (`kv_bytes_per_token` at ``tp``, plus
    ``extra_bytes_per_token``: a draft model's pool over the same pages). Raises ValueError:
    fewer than 2 fit."""
    page_bytes = page_size * (kv_bytes_per_token(model, dtype_bytes, tp) + extra_bytes_per_token)
    free = usable_bytes - used_bytes
    pages = max(int(free // page_bytes), 0)
    if pages < 2:
        raise ValueError(
            f"no memory left for the KV pool: usable {_gib(usable_bytes)} - used "
            f"{_gib(used_bytes)} = {_gib(free)} holds {pages} pages of {page_bytes:,} "
            "B, at least 2 are needed; raise gpu_memory_utilization or memory_fraction, set "
            f"num_pages, or start JAX with {XLA_MEM_FRACTION_ENV} above its default "
            f"{XLA_DEFAULT_MEM_FRACTION} (the share of the card JAX's allocator takes)"
        )
    return pages


XLA_MEM_FRACTION_ENV, XLA_DEFAULT_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75


def card_bytes_usable(utilization: float, bytes_limit: int) -> int:
    """Bytes for weights + KV pool under vLLM's ``gpu_memory_utilization``: ``utilization`` x
    the card's bytes (JAX's ``bytes_limit`` / its fraction, `XLA_MEM_FRACTION_ENV`, default
    0.75), less `default_reserve_bytes` for activations. Raises ValueError: more than
    ``bytes_limit``, the most JAX's allocator may use."""
    card = bytes_limit / float(os.environ.get(XLA_MEM_FRACTION_ENV, XLA_DEFAULT_MEM_FRACTION))
    if utilization * card > bytes_limit * 1.001:
        raise ValueError(
            f"EngineConfig.gpu_memory_utilization={utilization} is invalid: JAX's "
            f"allocator may use only {bytes_limit / card:.2f} of the card "
            f"({_gib(bytes_limit)}); set {XLA_MEM_FRACTION_ENV}={utilization} before "
            "JAX starts, or lower gpu_memory_utilization"
        )
    return min(int(utilization * card), bytes_limit) - default_reserve_bytes(int(card))


def _check_lora_fits(e, lora_bytes: int, usable: int, used: int, page_bytes: int) -> None:
    """ValueError naming ``max_loras`` and ``max_lora_rank`` of `EngineConfig` ``e`` when the
    LoRA pool's ``lora_bytes`` leave fewer than 2 KV pages of ``page_bytes`` in ``usable -
    used`` bytes where 2 would fit without it."""
    free = usable - used
    if free - lora_bytes < 2 * page_bytes <= free:
        raise ValueError(
            f"the LoRA pool does not fit: EngineConfig.max_loras={e.max_loras} x "
            f"max_lora_rank={e.max_lora_rank} takes {lora_bytes:,} B ({_gib(lora_bytes)}) of "
            f"the {_gib(free)} left (usable {_gib(usable)} - used {_gib(used)}), and the KV "
            f"pool needs at least {2 * page_bytes:,} B; lower max_loras or max_lora_rank"
        )


def engine_pool_pages(
    resolved: ResolvedConfig,
    memory_stats: dict | None,
    draft: ModelConfig | None = None,
    lora_bytes: int = 0,
) -> int:
    """``EngineConfig.num_pages`` if set; else with ``memory_stats`` (``Device.memory_stats()``,
    weights resident) `kv_pool_pages` of ``memory_fraction x bytes_limit - bytes_in_use -
    lora_bytes`` (with ``gpu_memory_utilization``: `card_bytes_usable` - ...; bytes_in_use
    rounded up to `USED_BYTES_STEP`, so a restart gets the same pool and hits the compilation
    cache); else (CPU) the null page + ``max_num_seqs`` sequences of ``max_model_len`` tokens,
    at most `CPU_KV_BUDGET_BYTES`; bytes per device under tensor parallelism; ``draft``: a
    draft model whose pool (compute dtype) shares the pages; ``lora_bytes``: the LoRA pool, not
    yet allocated (`jaxinfer.lora.peft.pool_bytes`). Raises ValueError: the LoRA pool leaves
    fewer than 2 pages (`_check_lora_fits`), fewer than 2 pages fit."""
    e, m, tp = resolved.engine, resolved.model, resolved.engine.tensor_parallel_size
    extra = draft.kv_bytes_per_token(resolved.dtype_bytes) if draft else 0
    page_bytes = e.page_size * (kv_bytes_per_token(m, resolved.kv_dtype_bytes, tp) + extra)
    if e.num_pages is not None:
        return e.num_pages
    if memory_stats and "bytes_limit" in memory_stats:
        usable = int(e.memory_fraction * memory_stats["bytes_limit"])
        if e.gpu_memory_utilization is not None:
            usable = card_bytes_usable(e.gpu_memory_utilization, memory_stats["bytes_limit"])
        used = -(-int(memory_stats.get("bytes_in_use", 0)) // USED_BYTES_STEP) * USED_BYTES_STEP
        _check_lora_fits(e, lora_bytes, usable, used, page_bytes)
        used += lora_bytes
    else:
        pages = 1 + e.max_num_seqs * -(-resolved.max_model_len // e.page_size)
        usable, used = min(pages * page_bytes, CPU_KV_BUDGET_BYTES), 0
    return kv_pool_pages(
        m,
        page_size=e.page_size,
        dtype_bytes=resolved.kv_dtype_bytes,
        usable_bytes=usable,
        used_bytes=used,
        tp=tp,
        extra_bytes_per_token=extra,
    )
