"""The EAGLE-3 method's jitted programs (`jaxinfer.runner.eagle3` compiles and runs them): the
target's forward with its aux hidden states (`forward_aux_step`, in place of `forward_step`
only when an EAGLE-3 head is configured), the head's entries of a target step (`mirror_step`)
and k chained drafting steps (`propose_step`). Sources: vLLM V1's ``EagleProposer`` (the first
step on the target's states, later steps on the head's own pre-norm output, greedy)."""

import jax
import jax.numpy as jnp

from jaxinfer.models import eagle3
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.runner.step import forward_step, unpack
from jaxinfer.step_input import ForwardKey, SamplerKey, Sizes, StepShape


def forward_aux_step(params, kv, buf, prev_tokens, *, key, sizes, cfg, kernels, aux_layers):
    """`forward_step` returning also the residual streams entering target layers
    ``aux_layers`` (`eagle3.AuxCapture`), concatenated: ((logits, hidden, aux [T, 3D]), kv')."""
    capture = eagle3.AuxCapture(aux_layers)
    with capture.capturing():
        out, kv = forward_step(
            params, kv, buf, prev_tokens, key=key, sizes=sizes, cfg=cfg, kernels=kernels
        )
    aux = capture.aux()
    return (*out, aux.reshape(-1, aux.shape[-1])), kv


def _rows(qsl: jax.Array, T: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(t i32[T], each token's row i32[T], real bool[T]) of ragged rows ``qsl`` i32[R + 1]."""
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, qsl.shape[0] - 2)
    return t, row, t < qsl[-1]


def mirror_step(
    head: dict,
    embed: jax.Array,
    kv: KVCache,
    buf: jax.Array,
    prev_tokens: jax.Array,
    aux: jax.Array,
    tail: jax.Array,
    first_src: jax.Array,
    *,
    key: ForwardKey,
    sizes: Sizes,
    cfg,
) -> tuple[KVCache, jax.Array]:
    """The head's entries of a target step (``buf``: its "forward" fields, ``prev_tokens`` as
    `forward_step`): the token at position p (pending ones from ``prev_tokens``) paired with
    h_{p-1} = fc(``aux`` [T, 3D])[p - 1] inside its row, for a row's first token the previous
    step's ``tail`` [max_rows, Q, D] at ``first_src[r]`` i32[R] (flat index r' * Q + j; -1:
    unknown, the entry is not written), written as entry p - 1 (position 0: none). Returns
    (kv', this step's tail: h of each row's last Q tokens, the one ending the row at Q - 1)."""
    f = unpack(buf, "forward", StepShape(key, SamplerKey(0, "greedy")), sizes)
    qsl, src = f["query_start_loc"], f["pending_src"]
    picked = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], f["tokens"][qsl[:-1]])
    tokens = f["tokens"].at[qsl[:-1]].set(picked, mode="drop")
    t, row, real = _rows(qsl, tokens.shape[0])
    own = eagle3.combine(head, aux)  # [T, D]
    Q, D = tail.shape[1], own.shape[-1]
    prev = tail.reshape(-1, D)[jnp.maximum(first_src, 0)]  # [R, D]
    start = t == qsl[row]
    hidden = jnp.where(start[:, None], prev[row], jnp.roll(own, 1, axis=0))
    q = f["positions"] - 1
    ok = real & (q >= 0) & (~start | (first_src[row] >= 0))
    P = kv.k.shape[3]
    page = jnp.take_along_axis(f["block_tables"][row], (jnp.maximum(q, 0) // P)[:, None], 1)
    slots = jnp.where(ok, page[:, 0] * P + jnp.maximum(q, 0) % P, 0)  # 0: the null page
    kv = eagle3.write_entries(head, cfg, embed, tokens, hidden, q, slots, kv)
    ends = qsl[1:, None] - Q + jnp.arange(Q, dtype=jnp.int32)  # [R, Q]
    new = own[jnp.clip(ends, 0, own.shape[0] - 1)]
    return kv, jnp.zeros_like(tail).at[: new.shape[0]].set(new.astype(tail.dtype))


def propose_step(
    head: dict,
    embed: jax.Array,
    kv: KVCache,
    tail: jax.Array,
    src: jax.Array,
    tokens: jax.Array,
    pos: jax.Array,
    tables: jax.Array,
    *,
    k: int,
    width: int,
    cfg,
    kernels,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """k greedy drafting steps of R rows: step j at position q = ``pos`` + j (i32[R]; clamped
    to the table's ``width`` pages) on token ``tokens`` i32[R] (then the previous draft) and
    h_q: first the target's, ``tail`` [max_rows, Q, D] at ``src`` i32[R] (-1: zeros), then the
    head's pre-norm output; entries written through ``tables`` i32[R, >= width] (past a row's
    pages: the null page). Returns (drafts i32[R, k] target ids, the first step's logits
    f32[R, Vd], kv' with its placeholder tables)."""
    D = tail.shape[-1]
    hidden = jnp.where((src >= 0)[:, None], tail.reshape(-1, D)[jnp.maximum(src, 0)], 0)
    P, toks, out, first = kv.k.shape[3], tokens, [], None
    step_kv = kv
    for j in range(k):
        q = jnp.minimum(pos + j, width * P - 1)
        slot = jnp.take_along_axis(tables, (q // P)[:, None], 1)[:, 0] * P + q % P
        step_kv = step_kv.replace(block_tables=tables[:, :width], seq_lens=q + 1)
        logits, hidden, step_kv = eagle3.decode(
            head, cfg, embed, toks, hidden, q, slot, step_kv, kernels=kernels
        )
        toks = eagle3.to_target(head, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        out.append(toks)
        first = logits if first is None else first
    new = step_kv.replace(block_tables=kv.block_tables, seq_lens=kv.seq_lens)
    return jnp.stack(out, axis=1), first, new


MIRROR_STEP = jax.jit(mirror_step, donate_argnums=(2,), static_argnames=("key", "sizes", "cfg"))
PROPOSE_STEP = jax.jit(
    propose_step, donate_argnums=(2,), static_argnames=("k", "width", "cfg", "kernels")
)
