"""The draft model of speculative decoding's "draft_model" method (device side): a smaller model
with the target's vocabulary, its own KV pool over the target's pages (the same page count and
size, so the target's block tables address both pools), run on every target step's forward
input (`mirror`: its K/V follows the target's) and for k greedy drafting steps (`propose`).
Source: vLLM V1's draft-model proposer (greedy drafts, the target's block tables)."""

import numpy as np

from jaxinfer import models
from jaxinfer.models.kv_cache import KVCache, init_kv_cache, stored_dtype
from jaxinfer.runner.executor import StepExecutor
from jaxinfer.runner.loading import load_params
from jaxinfer.step_input import BucketSpec, ForwardKey, HostBatch, SamplerKey, StepShape, allocate
from jaxinfer.step_input import bucket as bucket_of


def load_draft(path: str, target_cfg, dtype):
    """(config, params) of the draft checkpoint at ``path`` in ``dtype``. ValueError: its
    vocabulary is not the target's (the drafts are the target's token ids)."""
    cfg, params = load_params(path, dtype)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"its vocab_size={cfg.vocab_size} is not the target's: a draft model must share "
            f"the target's tokenizer (vocab_size={target_cfg.vocab_size})"
        )
    models.check_params(params, cfg, None)
    return cfg, params


def draft_batch(rows, k: int, buckets: BucketSpec, page_size: int):
    """The decode batch of ``rows`` (each: its last token, that token's position p, its block
    table) for k drafting steps from p: (a `HostBatch` of R = the row bucket, its tokens, block
    tables (M: the page bucket of p + k), row starts and logits rows set; tables i32[n, width +
    ceil(k / page_size) + 1], each row's table with zeros (the null page) past its pages;
    positions p i32[n]). The drafters of "draft_model" and "eagle3" share it."""
    n, P, sizes = len(rows), page_size, buckets.sizes
    R = bucket_of(n, buckets.batch)
    need = min(max(-(-(p + k) // P) for _, p, _ in rows), sizes.pages)
    M = bucket_of(need, buckets.pages) if buckets.pages else 0
    hb = allocate(StepShape(ForwardKey(R, True, M), SamplerKey(R, "greedy")), sizes)
    width = hb.block_tables.shape[1]  # a row at the table's end rewrites its last slot
    tables = np.zeros((n, width + -(-k // P) + 1), np.int32)
    for i, (tok, _, table) in enumerate(rows):
        tables[i, : min(len(table), width)] = table[:width]
        hb.tokens[i] = tok
    hb.block_tables[:n] = tables[:, :width]
    hb.query_start_loc[:] = np.minimum(np.arange(R + 1), n)
    hb.logits_indices[:, 0] = np.arange(R)
    return hb, tables, np.array([p for _, p, _ in rows], np.int32)


class DraftRunner:
    """The draft model ``cfg``/``params`` beside a target served under ``resolved`` with a pool
    of ``num_pages`` pages and ``buckets`` (the target's `BucketSpec`), its programs compiled
    by its own `StepExecutor` (``kernels``, ``kc``: the target's), compiles counted in
    ``stats``. One device only."""

    def __init__(self, cfg, params, resolved, num_pages, buckets: BucketSpec, kernels, stats):
        self.cfg, self.params, self.buckets = cfg, params, buckets
        self.page_size, self.num_pages = resolved.engine.page_size, num_pages
        self.dtype = stored_dtype(resolved.dtype, resolved.platform)
        self.reset_kv()
        self.executor = StepExecutor(cfg, kernels, resolved.kernels, buckets.sizes, 1, stats)

    def reset_kv(self) -> None:
        """A fresh (zeroed) pool: at start, and after an interrupted step took it."""
        self.kv: KVCache = init_kv_cache(self.cfg, self.num_pages, self.page_size, self.dtype)

    def mirror(self, hb: HostBatch, prev, fwd=None, embed=None) -> None:
        """Run the target step ``hb``'s forward on the draft (the same tokens, positions and
        slots; ``prev``: the step in flight's tokens), writing the draft's K/V. ``fwd``,
        ``embed`` (the target's forward and embedding): unused here (`Eagle3Runner`'s)."""
        _, self.kv = self.executor.forward(self.params, self.kv, hb, prev)

    def propose(self, rows: list[tuple[int, int, list[int]]], k: int, embed=None) -> np.ndarray:
        """i32[n, k] greedy drafts of ``rows`` (each: its last token, that token's position p,
        its block table): k decode steps, step j writing K/V at p + j (pages past the row's
        table: the null page; past the table's width: its last slot) and feeding its argmax to
        step j + 1 on the device; one read back. The K/V past p is written again when the
        target verifies (`mirror`). ``embed``: unused (`Eagle3Runner`'s)."""
        hb, tables, pos = draft_batch(rows, k, self.buckets, self.page_size)
        n, P, width = len(rows), self.page_size, hb.block_tables.shape[1]
        prev, out = None, []
        for j in range(k):
            at = np.minimum(pos + j, width * P - 1)
            hb.positions[:n] = at
            hb.slot_mapping[:n] = tables[np.arange(n), at // P] * P + at % P
            hb.seq_lens[:n] = at + 1
            hb.pending_src[:n] = -1 if j == 0 else np.arange(n)
            fwd, self.kv = self.executor.forward(self.params, self.kv, hb, prev)
            prev = self.executor.sample(fwd, hb)
            out.append(prev)
        return np.stack([np.asarray(t)[:n] for t in out], axis=1)

    def precompile(
        self, planned: dict | None, embed=None, *, max_workers: int | None = None
    ) -> None:
        """Compile the draft's programs: the forwards of the target's ``planned`` set (None:
        every forward, `BucketSpec.forward_keys`: `mirror`) and the decode forwards and greedy
        samplers at every row bucket (`propose`). ``embed``: unused (`Eagle3Runner`'s)."""
        forwards = (planned or {}).get("forward") or self.buckets.forward_keys()
        ms = self.buckets.pages or (0,)
        own = dict(
            forward=[*forwards, *(ForwardKey(r, True, m) for r in self.buckets.batch for m in ms)],
            sampler=[SamplerKey(r, "greedy") for r in self.buckets.batch],
        )
        _, self.kv = self.executor.precompile(self.params, self.kv, own, max_workers=max_workers)
