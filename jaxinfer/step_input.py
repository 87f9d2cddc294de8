"""The step-input schema: every array one engine step sends to the device, declared once.

Host side (numpy only, no JAX). From `FIELDS` derive: the arrays of a `HostBatch` (`allocate`,
with each field's padding value), the single int32 transfer buffer (`pack`), the all-padding batch
of ahead-of-time compiles (`empty_batch`), and the unpacking inside the jit
(`jaxinfer.step.unpack`), which groups the fields into ``StepInput``, ``SamplingMetadata`` and
``Packing`` by `Field.group`. A step's layout is a function of its `ShapeKey` alone, so the key
is the jit's static argument.

Padding (the null-page invariant, `jaxinfer.engine.block_manager.NULL_PAGE`): padded rows have
``seq_len 0`` and block-table entries ``NULL_PAGE``; padded tokens write into the null page and
are never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

INT32_MAX = 2**31 - 1


class ShapeKey(NamedTuple):
    """What a compiled step is specialised on.

    batch:       B rows (sequences; R rows of a packed prefill step).
    tokens:      T query tokens per row (decode: 1), or Tp packed tokens in all (packed).
    pages:       M block-table entries per row.
    penalty:     R' penalty tokens per row (0: no row uses a repetition penalty).
    query:       Tq query tokens per row of a packed prefill step; None: not packed.
    all_greedy:  every row greedy (the sampler skips sort and draw).
    """

    batch: int
    tokens: int
    pages: int
    penalty: int
    query: int | None
    all_greedy: bool

    @property
    def packed(self) -> bool:
        return self.query is not None

    def dims(self) -> dict[str, int]:
        """Sizes of the schema's dimension names: ``Bt``/``T`` are the token arrays' rows and
        columns ([B, T] unpacked, [1, Tp] packed), ``Q`` is Tq (0 unpacked)."""
        return dict(B=self.batch, Bt=1 if self.packed else self.batch, T=self.tokens,
                    M=self.pages, R=self.penalty, Q=self.query or 0)


class Field(NamedTuple):
    """One device input: ``group`` is "input" (`StepInput`), "kv" (the cache's block tables and
    lengths), "sampling" (`SamplingMetadata`) or "packing" (`Packing`, packed steps only)."""

    name: str
    dtype: type
    shape: tuple[str, ...]
    group: str
    pad: int | float = 0


FIELDS = (
    Field("tokens", np.int32, ("Bt", "T"), "input"),
    Field("positions", np.int32, ("Bt", "T"), "input"),
    Field("slot_mapping", np.int32, ("Bt", "T"), "input"),   # page * page_size + offset
    Field("logits_indices", np.int32, ("B",), "input"),      # the token of each row sampled
    Field("pending_src", np.int32, ("B",), "input", -1),     # row of prev_tokens, or -1
    Field("block_tables", np.int32, ("B", "M"), "kv"),
    Field("seq_lens", np.int32, ("B",), "kv"),
    Field("temperature", np.float32, ("B",), "sampling"),
    Field("top_k", np.int32, ("B",), "sampling"),            # 0: off
    Field("top_p", np.float32, ("B",), "sampling", 1.0),
    Field("min_p", np.float32, ("B",), "sampling"),
    Field("repetition_penalty", np.float32, ("B",), "sampling", 1.0),
    Field("seeds", np.uint32, ("B",), "sampling"),
    Field("step_idx", np.int32, ("B",), "sampling"),
    Field("penalty_tokens", np.int32, ("B", "R"), "sampling", -1),
    Field("q_index", np.int32, ("B", "Q"), "packing"),
    Field("q_positions", np.int32, ("B", "Q"), "packing"),
    Field("out_index", np.int32, ("T",), "packing"),
)


def fields(key: ShapeKey) -> tuple[Field, ...]:
    """The fields a step of shape ``key`` sends, in buffer order (packing fields: packed only)."""
    return tuple(f for f in FIELDS if f.group != "packing" or key.packed)


def layout(key: ShapeKey) -> tuple[tuple[Field, tuple[int, ...]], ...]:
    """``((field, shape), ...)`` in buffer order for a step of shape ``key``."""
    d = key.dims()
    return tuple((f, tuple(d[n] for n in f.shape)) for f in fields(key))


@dataclass(frozen=True)
class HostBatch:
    """One step's arrays (``arrays``: name -> array per `layout`, also ``hb.tokens`` etc.), its
    `ShapeKey`, and host-only row masks: ``sample_rows`` (the sampled token is real),
    ``pending_rows`` (the input token is the previous step's device output)."""

    key: ShapeKey
    arrays: dict
    sample_rows: np.ndarray
    pending_rows: np.ndarray

    def __getattr__(self, name):
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def shape_key(self) -> ShapeKey:
        return self.key

    @property
    def packed(self) -> bool:
        return self.key.packed


def allocate(key: ShapeKey) -> HostBatch:
    """An all-padding `HostBatch` of shape ``key`` (each field filled with its ``pad``): the
    batch builder fills the real rows; ahead-of-time compiles and warm runs use it as is."""
    arrays = {f.name: np.full(shape, f.pad, f.dtype) for f, shape in layout(key)}
    return HostBatch(key, arrays, np.zeros((key.batch,), bool), np.zeros((key.batch,), bool))


empty_batch = allocate


def pack(hb: HostBatch) -> np.ndarray:
    """Every field of ``hb`` in one i32[S] buffer in `layout` order (f32/u32 bit-cast, not
    converted): one transfer a step. Raises TypeError: a dtype or shape not the schema's."""
    parts = []
    for f, shape in layout(hb.key):
        a = np.ascontiguousarray(hb.arrays[f.name])
        if a.dtype != f.dtype or a.shape != shape:
            raise TypeError(f"HostBatch.{f.name} is {a.dtype}{list(a.shape)}; the schema needs "
                            f"{np.dtype(f.dtype)}{list(shape)}")
        parts.append(a.view(np.int32).reshape(-1))
    return np.concatenate(parts)
