"""The step's three jitted programs, each compiled by sizes alone (`jaxinfer.step_input`): the
forward (`forward_step`: model, KV write, logits of each row's last token; KV donated), the
sampler (`sample_step`) and the prompt scorer (`prompt_step`). `jaxinfer.runner.executor`
compiles and runs them."""

import math

import jax
import jax.numpy as jnp

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models.kernels import ModelKernels
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.layers import Ragged, by_token
from jaxinfer.runner.parallel import gather_logits
from jaxinfer.runner.rejection import verify
from jaxinfer.runner.sampling import (
    SamplingMetadata,
    _penalised,
    apply_logits_processors,
    apply_token_bitmask,
    logprobs,
    sample,
)
from jaxinfer.step_input import ForwardKey, SamplerKey, Sizes, StepShape, layout, names


def unpack(buf: jax.Array, group: str, shape: StepShape, sizes: Sizes) -> dict:
    """Inverse of `step_input.pack` (``shape`` static): name -> array of program ``group``."""
    out, off = {}, 0
    for f, dims in layout(group, shape, sizes):
        n = math.prod(dims)
        x = buf[off : off + n].reshape(dims)
        if jnp.dtype(f.dtype) != jnp.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(f.dtype))
        out[f.name] = x
        off += n
    return out


def _forward_shape(key: ForwardKey) -> StepShape:
    return StepShape(key, SamplerKey(0, "greedy"))


def forward_step(
    params: dict,
    kv: KVCache,
    buf: jax.Array,
    prev_tokens: jax.Array,
    *,
    key: ForwardKey,
    sizes: Sizes,
    cfg: ModelConfig,
    kernels: ModelKernels,
) -> tuple[tuple[jax.Array, jax.Array], KVCache]:
    """The model over one step's T tokens (``buf``: the "forward" fields): each row r's first
    token replaced by ``prev_tokens[pending_src[r]]`` i32[max_rows] where that is >= 0 (async
    scheduling), K/V written, attention decode-only ([T, 1] rows) or ragged (tokens [1, T]).
    Returns ((logits f32[R * Q, V] of each row's ``logits_indices`` tokens, whole on every
    device; hidden [T, D], the final-normed states), kv'); ``kv``'s tables are placeholders.
    ``params["lora"]``: the LoRA pool, each row's adapter its ``lora_slots`` entry."""
    f = unpack(buf, "forward", _forward_shape(key), sizes)
    starts, src = f["query_start_loc"][:-1], f["pending_src"]
    picked = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], f["tokens"][starts])
    tokens = f["tokens"].at[starts].set(picked, mode="drop")
    step_kv = kv.replace(block_tables=f["block_tables"], seq_lens=f["seq_lens"])
    # decode: row r is token r, the [B, T=1] layout of the decode kernels; else rows over [1, T]
    lay = (lambda x: x[:, None]) if key.decode else (lambda x: x[None])
    hidden, new = models.forward(
        params,
        cfg,
        lay(tokens),
        lay(f["positions"]),
        lay(f["slot_mapping"]),
        step_kv,
        kernels=kernels,
        ragged=None if key.decode else _ragged(f, kernels, key),
        lora_slots=lay(_token_slots(f, key)) if "lora" in params else None,
    )
    hidden = hidden.reshape(-1, hidden.shape[-1])
    with jax.named_scope("lm_head"):
        logits = models.compute_logits(params, cfg, hidden[f["logits_indices"].reshape(-1)])
        logits = gather_logits(logits, cfg, kernels.mesh)
    return (logits, hidden), new.replace(block_tables=kv.block_tables, seq_lens=kv.seq_lens)


def _token_slots(f: dict, key: ForwardKey) -> jax.Array:
    """Each token's LoRA slot i32[T]: its row's ``lora_slots`` (padding tokens: -1)."""
    if key.decode:  # token r is row r
        return f["lora_slots"]
    qsl, t = f["query_start_loc"], jnp.arange(f["tokens"].shape[0], dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, qsl.shape[0] - 2)
    return jnp.where(t < qsl[-1], f["lora_slots"][row], -1)


def _ragged(f: dict, kernels: ModelKernels, key: ForwardKey) -> Ragged:
    """The step's ragged rows; a verify step (``key.spec``) of at most
    ``kernels.ragged_decode_max_tokens`` tokens attends token by token (`by_token`): its rows
    are k + 1 tokens long, while a plain step's prefill chunk, token by token, would read its
    row's K/V once per token."""
    if not key.spec or f["tokens"].shape[0] > kernels.ragged_decode_max_tokens:
        return Ragged(f["query_start_loc"])
    return by_token(f["query_start_loc"], f["block_tables"], f["positions"])


def sample_step(
    logits: jax.Array, buf: jax.Array, *, key: SamplerKey, sizes: Sizes, num_logprobs: int
) -> jax.Array | dict:
    """``logits`` f32[R * Q, V] -> token ids i32[max_rows] (zero past R), by ``buf``'s
    "sampling" fields: at level "full" the logits processors, the bitmask (vLLM: the sampler
    and logprobs see it), then `sample` (or, ``key.spec`` > 0, `verify`: `_verify_step`),
    returning at level "full" or when verifying {"tokens", and `logprobs`' arrays at K =
    ``num_logprobs`` (the host cuts each row's K), and `_verify_step`'s}."""
    shape = StepShape(ForwardKey(key.rows, True), key)
    meta = SamplingMetadata(**unpack(buf, "sampling", shape, sizes))
    if key.spec:
        return _verify_step(logits, meta, key, sizes, num_logprobs)
    if key.level == "full":
        logits = apply_logits_processors(logits, meta, key.processors)
        logits = apply_token_bitmask(logits, meta.bitmask)
    with jax.named_scope("sample"):
        tokens = sample(logits, meta, all_greedy=key.level == "greedy")
    padded = jnp.zeros((sizes.max_rows,), jnp.int32).at[: tokens.shape[0]].set(tokens)
    if key.level != "full":
        return padded
    with jax.named_scope("logprobs"):
        return dict(tokens=padded, **logprobs(logits, tokens, num_logprobs))


def _verify_step(logits, meta, key: SamplerKey, sizes: Sizes, num_logprobs: int) -> dict:
    """A verify step's sampler: ``logits`` f32[R * Q, V] (row r's positions r * Q ..), the
    row-wise ``meta`` repeated over each row's Q positions for the level "full" transforms
    (penalties and bias in `verify`'s processing), then `rejection.verify` with the drafts.
    Returns {"tokens": i32[max_rows] each row's last emitted token, "emitted": i32[R, Q],
    "num_emitted": i32[R], and at level "full" `logprobs` of position 0 (rows without drafts:
    the rows that ask for log-probabilities are never given drafts)}."""
    R, Q = key.rows, key.spec + 1
    drafts, meta = meta.draft_tokens, meta.replace(draft_tokens=None)
    if key.level == "full":
        rep = jax.tree.map(lambda a: jnp.repeat(a, Q, axis=0), meta)
        logits = apply_logits_processors(logits, rep, key.processors)
        logits = apply_token_bitmask(logits, rep.bitmask)
        logits = _penalised(logits, rep)
        meta = SamplingMetadata(**{n: getattr(meta, n) for n in names("sampling", "greedy")})
    logits = logits.reshape(R, Q, -1)
    with jax.named_scope("verify"):
        emitted, num = verify(logits, meta, drafts, all_greedy=key.level == "greedy")
    last = jnp.take_along_axis(emitted, (num - 1)[:, None], axis=1)[:, 0]
    out = dict(
        tokens=jnp.zeros((sizes.max_rows,), jnp.int32).at[:R].set(last),
        emitted=emitted,
        num_emitted=num,
    )
    if key.level == "full":
        with jax.named_scope("logprobs"):
            out.update(logprobs(logits[:, 0], emitted[:, 0], num_logprobs))
    return out


def prompt_step(
    params: dict,
    hidden: jax.Array,
    buf: jax.Array,
    *,
    prompt: int,
    sizes: Sizes,
    cfg: ModelConfig,
    kernels: ModelKernels,
    num_logprobs: int,
) -> dict:
    """`logprobs` (K = ``num_logprobs``) of each scored prompt position of ``hidden`` [T, D]
    (``buf``: i32[P] flat token indices, then the prompt token after each), keys prefixed
    ``prompt_``."""
    shape = StepShape(ForwardKey(1, True), SamplerKey(0, "greedy"), prompt)
    f = unpack(buf, "prompt", shape, sizes)
    idx, nxt = f["prompt_lp_index"], f["prompt_lp_next"]
    with jax.named_scope("prompt_logprobs"):
        logits = gather_logits(models.compute_logits(params, cfg, hidden[idx]), cfg, kernels.mesh)
        return {f"prompt_{k}": a for k, a in logprobs(logits, nxt, num_logprobs).items()}
