"""The ragged forward (rows' tokens back to back in one [1, T] token row, `models.Ragged`)
computes the same hidden states and K/V as the padded [R, Tq] layout (each row padded to the
longest chunk), which `test_models_vs_hf` checks against HF transformers. Covers a decode row
(one token), chunks that continue a cached prefix (start > 0), ragged chunk lengths, padded
tokens at the end of the row and a padded row, GQA and page boundaries; both ragged layouts:
the tiles and token by token (`layers.by_token`, each token a decode row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.layers import by_token

PAGE = 4
# (tokens already cached, chunk length) per row
ROWS = [(0, 5), (6, 7), (4, 5), (9, 1)]


def _cfg(arch):
    return ModelConfig(
        architecture=arch,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )


def _params(cfg, arch: str) -> dict:
    params = models.init_params(cfg, jax.random.key(1), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 5.0 if p.ndim == 2 else p, params)  # sharper
    if arch == "qwen3":  # q/k norm weights away from 1, so a skipped or swapped one shows
        for lp in params["layers"].values():
            lp["q_norm"], lp["k_norm"] = lp["q_norm"] * 1.5, lp["k_norm"] * 0.5
    return params


class Case:
    """The rows' token sequences, their page tables (page 0: null) and stale K/V pools."""

    def __init__(self, cfg, rng):
        R, M = len(ROWS), 4
        self.cfg, self.pages = cfg, rng.permutation(np.arange(1, 1 + R * M)).reshape(R, M)
        self.pages = self.pages.astype(np.int32)
        self.total = [c + n for c, n in ROWS]
        self.seqs = [rng.integers(0, cfg.vocab_size, t).astype(np.int32) for t in self.total]
        shape = (cfg.num_layers, 1 + R * M, cfg.num_kv_heads, PAGE, cfg.head_dim)
        self.k0 = jnp.asarray(rng.standard_normal(shape), jnp.float32)  # garbage, never zeros
        self.v0 = jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def slots(self, i, pos):
        return self.pages[i, pos // PAGE] * PAGE + pos % PAGE

    def unpacked(self, params, start_of, len_of, kv):
        """The padded [R, Tq] forward of each row's tokens [start, start + len)."""
        R, T = len(ROWS), max(max(len_of), 1)
        tok, pos, slot = (np.zeros((R, T), np.int32) for _ in range(3))  # padding: null page
        for i in range(R):
            c, n = start_of[i], len_of[i]
            tok[i, :n], pos[i, :n] = self.seqs[i][c : c + n], np.arange(c, c + n)
            slot[i, :n] = self.slots(i, np.arange(c, c + n))
        kv = kv.replace(
            block_tables=jnp.asarray(self.pages),
            seq_lens=jnp.asarray([c + n for c, n in zip(start_of, len_of)], jnp.int32),
        )
        return models.forward(
            params, self.cfg, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(slot), kv
        )

    def ragged(self, params, kv, layout: str):
        """The ragged [1, Tp] forward of every row's chunk, 3 padding tokens and a padding row."""
        R, Tp = len(ROWS), sum(n for _, n in ROWS) + 3
        tok, pos, slot = (np.zeros((1, Tp), np.int32) for _ in range(3))
        qsl, off = np.full((R + 2,), Tp - 3, np.int32), 0
        for i, (c, n) in enumerate(ROWS):
            tok[0, off : off + n], pos[0, off : off + n] = (
                self.seqs[i][c : c + n],
                np.arange(c, c + n),
            )
            slot[0, off : off + n] = self.slots(i, np.arange(c, c + n))
            qsl[i], off = off, off + n
        tables = np.concatenate([self.pages, np.zeros((1, self.pages.shape[1]), np.int32)])
        kv = kv.replace(
            block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(self.total + [0], jnp.int32)
        )
        ragged = (
            models.Ragged(jnp.asarray(qsl))
            if layout == "tiles"
            else by_token(jnp.asarray(qsl), jnp.asarray(tables), jnp.asarray(pos[0]))
        )
        args = (jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(slot), kv)
        return models.forward(params, self.cfg, *args, ragged=ragged)


@pytest.mark.parametrize("layout", ["tiles", "by_token"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ragged_forward_matches_padded(arch, layout):
    cfg = _cfg(arch)
    params, case = _params(cfg, arch), Case(cfg, np.random.default_rng(0))
    R = len(ROWS)
    kv = KVCache(case.k0, case.v0, jnp.asarray(case.pages), jnp.zeros(R, jnp.int32))
    # cache the prefixes (row 0 has none: a 1-token dummy chunk into the null page)
    starts = [c for c, _ in ROWS]
    _, kv = case.unpacked(params, [0] * R, starts, kv)
    kv = kv.replace(k=kv.k.at[:, 0].set(0.0), v=kv.v.at[:, 0].set(0.0))
    h_ref, kv_ref = case.unpacked(params, starts, [n for _, n in ROWS], kv)
    h_pk, kv_pk = case.ragged(params, kv, layout)

    assert h_pk.shape == (1, sum(n for _, n in ROWS) + 3, cfg.hidden_size)
    off = 0
    for i, (_, n) in enumerate(ROWS):
        a, b = np.asarray(h_pk[0, off : off + n]), np.asarray(h_ref[i, :n])
        assert np.abs(b).max() > 0.1
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        off += n
    # every real slot holds the same K/V
    real = np.concatenate([case.slots(i, np.arange(t)) for i, t in enumerate(case.total)])
    for pool_pk, pool_ref in ((kv_pk.k, kv_ref.k), (kv_pk.v, kv_ref.v)):
        flat = lambda p: (  # noqa: E731
            np.asarray(p)
            .transpose(0, 1, 3, 2, 4)
            .reshape(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
        )
        np.testing.assert_allclose(
            flat(pool_pk)[:, real], flat(pool_ref)[:, real], rtol=1e-5, atol=1e-5
        )
