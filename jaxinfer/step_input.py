"""The step-input schema (numpy only): `FIELDS` gives a `HostBatch`'s arrays and padding
(`allocate`), the int32 transfer buffer (`pack`) and its unpacking (`runner.step.unpack`); the
layout depends on the `ShapeKey` alone. Padded rows have ``seq_len`` 0 and null-page tables."""

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

INT32_MAX = 2**31 - 1


class ShapeKey(NamedTuple):
    """What a step is compiled for: B rows; T tokens per row (Tp in all when packed); M pages;
    penalty R tokens per row (0: no penalty reads history); query Tq per packed row (None: not
    packed); all_greedy; bias E sparse (id, value) entries per row (logit_bias, min_tokens; 0:
    none); logprobs: the top-k K returned per sampled row and prompt position (0: no
    log-probabilities); prompt_logprobs P prompt positions scored (0: none; needs K > 0);
    bitmask: W = ceil(V / 32) words per row of the allowed-token bitmask, set only when a sampled
    row is constrained (0: none; unconstrained steps keep their keys); processors: the distinct
    logits processors of the sampled rows, in order of first use (a new tuple compiles anew)."""

    batch: int
    tokens: int
    pages: int
    penalty: int
    query: int | None
    all_greedy: bool
    bias: int = 0
    logprobs: int = 0
    prompt_logprobs: int = 0
    bitmask: int = 0
    processors: tuple = ()

    packed = property(lambda self: self.query is not None)

    def dims(self) -> dict[str, int]:
        """Sizes of the shape letters (token arrays [Bt, T]: [B, T], or [1, Tp] packed)."""
        return dict(
            B=self.batch,
            Bt=1 if self.packed else self.batch,
            T=self.tokens,
            M=self.pages,
            R=self.penalty,
            Q=self.query or 0,
            E=self.bias,
            P=self.prompt_logprobs,
            W=self.bitmask,
            J=len(self.processors),
        )


class Field(NamedTuple):
    """A device input of ``group`` (`names`), present if `ShapeKey`'s ``when`` (None: always)."""

    name: str
    dtype: type
    shape: tuple[str, ...]
    group: str
    pad: int | float = 0
    when: str | None = None


FIELDS = (
    Field("tokens", np.int32, ("Bt", "T"), "input"),
    Field("positions", np.int32, ("Bt", "T"), "input"),
    Field("slot_mapping", np.int32, ("Bt", "T"), "input"),  # page * page_size + offset
    Field("logits_indices", np.int32, ("B",), "input"),  # the token of each row sampled
    Field("pending_src", np.int32, ("B",), "input", -1),  # row of prev_tokens, or -1
    Field("block_tables", np.int32, ("B", "M"), "kv"),
    Field("seq_lens", np.int32, ("B",), "kv"),
    Field("temperature", np.float32, ("B",), "sampling"),
    Field("top_k", np.int32, ("B",), "sampling"),  # 0: off
    Field("top_p", np.float32, ("B",), "sampling", 1.0),
    Field("min_p", np.float32, ("B",), "sampling"),
    Field("repetition_penalty", np.float32, ("B",), "sampling", 1.0),
    Field("seeds", np.uint32, ("B",), "sampling"),
    Field("step_idx", np.int32, ("B",), "sampling"),
    Field("penalty_tokens", np.int32, ("B", "R"), "sampling", -1),  # prompt + output ids
    Field("prompt_lens", np.int32, ("B",), "sampling", 0, "penalty"),  # prompt part of them
    Field("presence_penalty", np.float32, ("B",), "sampling", 0, "penalty"),
    Field("frequency_penalty", np.float32, ("B",), "sampling", 0, "penalty"),
    Field("bias_ids", np.int32, ("B", "E"), "sampling", -1, "bias"),
    Field("bias_values", np.float32, ("B", "E"), "sampling", 0, "bias"),
    Field("bitmask", np.int32, ("B", "W"), "sampling", -1, "bitmask"),  # bit v%32 of [b, v//32]
    Field("processor_rows", np.int32, ("B", "J"), "sampling", 0, "processors"),  # 1: row uses j
    Field("prompt_lp_index", np.int32, ("P",), "input", 0, "prompt_logprobs"),  # flat token
    Field("prompt_lp_next", np.int32, ("P",), "input", -1, "prompt_logprobs"),  # its next id
    Field("q_index", np.int32, ("B", "Q"), "packing", 0, "packed"),
    Field("q_positions", np.int32, ("B", "Q"), "packing", 0, "packed"),
    Field("out_index", np.int32, ("T",), "packing", 0, "packed"),
)


def names(group: str) -> tuple[list[str], list[str]]:
    """Names of ``group``'s fields in `FIELDS` order: (always present, present only ``when``)."""
    return (
        [f.name for f in FIELDS if f.group == group and f.when is None],
        [f.name for f in FIELDS if f.group == group and f.when is not None],
    )


def layout(key: ShapeKey) -> tuple[tuple[Field, tuple[int, ...]], ...]:
    """``((field, shape), ...)`` in buffer order for a step of shape ``key``."""
    d = key.dims()
    return tuple(
        (f, tuple(d[n] for n in f.shape)) for f in FIELDS if f.when is None or getattr(key, f.when)
    )


@dataclass(frozen=True)
class HostBatch:
    """``arrays`` (name -> array, also ``hb.tokens``), `ShapeKey`, host-only row masks
    ``sample_rows`` (sampled token real) and ``pending_rows`` (input token on the device), and
    ``prompt_lp_rows`` i32[P]: the row of each scored prompt position (-1: padding)."""

    key: ShapeKey
    arrays: dict
    sample_rows: np.ndarray
    pending_rows: np.ndarray
    prompt_lp_rows: np.ndarray | None = None

    def __getattr__(self, name):
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None


def allocate(key: ShapeKey) -> HostBatch:
    """An all-padding `HostBatch` of shape ``key`` (each field at its ``pad``)."""
    arrays = {f.name: np.full(shape, f.pad, f.dtype) for f, shape in layout(key)}
    return HostBatch(
        key,
        arrays,
        np.zeros((key.batch,), bool),
        np.zeros((key.batch,), bool),
        np.full((key.prompt_logprobs,), -1, np.int32),
    )


def pack(hb: HostBatch) -> np.ndarray:
    """``hb``'s fields as one i32[S] (`layout`; f32/u32 bit-cast); TypeError: not the schema."""
    parts = []
    for f, shape in layout(hb.key):
        a = np.ascontiguousarray(hb.arrays[f.name])
        if a.dtype != f.dtype or a.shape != shape:
            raise TypeError(
                f"HostBatch.{f.name} is {a.dtype}{list(a.shape)}; the schema needs "
                f"{np.dtype(f.dtype)}{list(shape)}"
            )
        parts.append(a.view(np.int32).reshape(-1))
    return np.concatenate(parts)


def covers(a: ShapeKey, b: ShapeKey) -> bool:
    """Whether a step of shape ``a`` runs a batch of shape ``b`` padded: the same packing and
    features, B, T, M (and Q) no smaller; a sampling ``a`` also runs an all-greedy ``b``."""
    same = (
        a._replace(
            batch=b.batch, tokens=b.tokens, pages=b.pages, query=b.query, all_greedy=b.all_greedy
        )
        == b
    )
    return (
        same
        and a.packed == b.packed
        and (b.all_greedy or not a.all_greedy)
        and a.batch >= b.batch
        and a.tokens >= b.tokens
        and a.pages >= b.pages
        and (a.query or 0) >= (b.query or 0)
    )


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2*lo, ...`` up to the first power >= hi, with ``hi`` itself as the last bucket."""
    return tuple(sorted({*(lo << i for i in range(hi.bit_length()) if lo << i < hi), hi}))


def default_batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two to 64, then ``64 + k * max(16, max_num_seqs // 16)``, then ``max_num_seqs``."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    small, step = powers_of_two(1, min(64, max_num_seqs)), max(16, max_num_seqs // 16)
    return tuple(sorted(set(small + tuple(range(64 + step, max_num_seqs, step)) + (max_num_seqs,))))


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Raises ValueError: ``n`` exceeds the largest bucket."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class BucketSpec:
    """Padded B, Tq, M and packed Tp (powers of two to a quarter of the budget, then multiples)."""

    batch: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    pages: tuple[int, ...]
    packed_tokens: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        page_size: int,
        batch_buckets: tuple[int, ...] = (),
        token_buckets: tuple[int, ...] = (),
    ) -> "BucketSpec":
        max_pages, top = -(-max_model_len // page_size), max(16, max_num_batched_tokens)
        quarter = max(512, top // 4)
        fine = tuple(b for b in powers_of_two(16, quarter) if b < top)
        fine += tuple(range(quarter, top, quarter)) + (top,)
        return cls(
            batch=batch_buckets or default_batch_buckets(max_num_seqs),
            prefill_tokens=token_buckets or powers_of_two(16, top),
            pages=powers_of_two(1, max_pages),
            packed_tokens=token_buckets or tuple(sorted(set(fine))),
        )

    def covering_keys(self) -> list[ShapeKey]:
        """Sampling shapes without optional features that `covers` such shapes these buckets
        produce: decode at the most rows and pages; packed at the most tokens and pages, per
        query bucket Q the most rows a step with a chunk in Q can have, but at most those of
        the widest bucket <= 8 Tp / Q (attention's [B, Q] query rows stay <= 8 Tp)."""
        B, Tp, M = self.batch[-1], self.packed_tokens[-1], self.pages[-1]
        keys, lo = [ShapeKey(B, 1, M, 0, None, False)], 2  # lo: the least chunk of bucket Q
        for q in self.prefill_tokens:
            if lo > min(q, Tp):
                break
            fit = [b for b in self.batch if b * q <= 8 * Tp] or [1]
            rows = min(bucket(min(B, Tp - lo + 1), self.batch), fit[-1])
            keys.append(ShapeKey(rows, Tp, M, 0, q, False))
            lo = q + 1
        return keys
