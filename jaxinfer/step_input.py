"""The step-input schema (numpy only). A step is three compiled programs, each keyed by sizes
alone: the forward (`ForwardKey`: T tokens, decode-only or ragged), the sampler (`SamplerKey`: R
rows and a feature level) and, when a prompt's log-probabilities are asked, the prompt scorer
(P positions). `FIELDS` gives each program's int32 transfer buffer (`pack`; unpacked on the
device by `jaxinfer.runner.step`); `BucketSpec` the padded sizes and `BucketSpec.planned` the
whole set compiled before serving. Padded rows have ``seq_len`` 0 and null-page tables; padded
tokens write their K/V to the null page."""

import bisect
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

INT32_MAX = 2**31 - 1
LEVELS = ("greedy", "sample", "full")  # sampler feature levels, cheapest first
BIAS_BUCKETS = (128, 1024, 8192, 65536)  # logit_bias + min_tokens entries per row at level full


class ForwardKey(NamedTuple):
    """The forward's static sizes: ``tokens`` T (padded) and ``decode``: every row one token (the
    tokens laid out as [T, 1] rows, the decode kernel), else ragged rows over tokens [1, T];
    ``pages`` M, the block tables' width (0: `Sizes.pages`, the most a row can have; a page
    bucket only where the attention's cost grows with M, the jnp reference's); ``spec`` k:
    speculative decoding's verify step (ragged; at most `Sizes.spec_rows` rows, each scored at
    Q = k + 1 positions; 0: one position per row)."""

    tokens: int
    decode: bool
    pages: int = 0
    spec: int = 0


class SamplerKey(NamedTuple):
    """The sampler's static sizes: ``rows`` R; ``level`` (`LEVELS`): "greedy" (argmax only),
    "sample" (temperature, top-k/p, min-p, seeds), "full" (also penalties over the whole
    history, logit bias, the grammar bitmask and log-probabilities at ``max_logprobs``);
    ``bias`` E entries per row (level full; `BIAS_BUCKETS`); ``processors``: the distinct
    logits processors of the sampled rows (user functions: each new tuple compiles anew);
    ``spec`` k: the rows' logits come at Q = k + 1 positions each and `rejection.verify` emits
    1 .. k + 1 tokens a row (0: `sampling.sample`, one token a row)."""

    rows: int
    level: str
    bias: int = 0
    processors: tuple = ()
    spec: int = 0


class StepShape(NamedTuple):
    """One step's programs: `ForwardKey`, `SamplerKey`, and ``prompt`` P scored prompt positions
    (0: the prompt scorer does not run)."""

    forward: ForwardKey
    sampler: SamplerKey
    prompt: int = 0


class Field(NamedTuple):
    """An input of program ``group`` with ``shape`` in shape letters, padded with ``pad``;
    ``level``: the sampler levels it is present at (None: all); ``spec``: present only in
    speculative steps (`SamplerKey.spec` > 0)."""

    name: str
    dtype: type
    shape: tuple[str, ...]
    group: str
    pad: int | float = 0
    levels: tuple[str, ...] | None = None
    spec: bool = False


FULL = ("full",)
FIELDS = (
    Field("tokens", np.int32, ("T",), "forward"),
    Field("positions", np.int32, ("T",), "forward"),
    Field("slot_mapping", np.int32, ("T",), "forward"),  # page * page_size + offset
    Field("query_start_loc", np.int32, ("R1",), "forward"),  # row r: tokens [q[r], q[r + 1])
    Field("seq_lens", np.int32, ("R",), "forward"),  # KV length after this step's write
    Field("block_tables", np.int32, ("R", "M"), "forward"),
    Field("logits_indices", np.int32, ("R", "Q"), "forward"),  # the tokens of each row scored
    Field("pending_src", np.int32, ("R",), "forward", -1),  # row of prev_tokens, or -1
    Field("lora_slots", np.int32, ("R",), "forward", -1),  # the row's LoRA pool slot, or -1
    Field("temperature", np.float32, ("R",), "sampling"),
    Field("top_k", np.int32, ("R",), "sampling"),  # 0: off
    Field("top_p", np.float32, ("R",), "sampling", 1.0),
    Field("min_p", np.float32, ("R",), "sampling"),
    Field("seeds", np.uint32, ("R",), "sampling"),
    Field("step_idx", np.int32, ("R",), "sampling"),
    Field("repetition_penalty", np.float32, ("R",), "sampling", 1.0, FULL),
    Field("penalty_tokens", np.int32, ("R", "Lh"), "sampling", -1, FULL),  # prompt + outputs
    Field("prompt_lens", np.int32, ("R",), "sampling", 0, FULL),  # prompt part of them
    Field("presence_penalty", np.float32, ("R",), "sampling", 0, FULL),
    Field("frequency_penalty", np.float32, ("R",), "sampling", 0, FULL),
    Field("bias_ids", np.int32, ("R", "E"), "sampling", -1, FULL),
    Field("bias_values", np.float32, ("R", "E"), "sampling", 0, FULL),
    Field("bitmask", np.int32, ("R", "W"), "sampling", -1, FULL),  # bit v%32 of [r, v//32]
    Field("processor_rows", np.int32, ("R", "J"), "sampling", 0, FULL),  # 1: row uses j
    Field("draft_tokens", np.int32, ("R", "Q"), "sampling", -1, None, True),  # then -1s
    Field("prompt_lp_index", np.int32, ("P",), "prompt"),  # flat token index scored
    Field("prompt_lp_next", np.int32, ("P",), "prompt", -1),  # the prompt token after it
)


def _present(f: Field, group: str, level: str, spec: int) -> bool:
    return f.group == group and (f.levels is None or level in f.levels) and (spec or not f.spec)


def names(group: str, level: str = "full", spec: int = 0) -> list[str]:
    """Names of ``group``'s fields present at sampler ``level`` (and ``spec``), in `FIELDS`
    order."""
    return [f.name for f in FIELDS if _present(f, group, level, spec)]


@dataclass(frozen=True)
class Sizes:
    """The engine's fixed sizes the schema needs: ``pages`` M per row, ``history`` Lh (the
    penalty history, max_model_len), ``mask_words`` W (ceil(V / 32)), ``max_rows`` (the
    largest row bucket: prev_tokens' length), ``spec_rows`` (the rows of a speculative step's
    forward; 0: no speculation)."""

    pages: int
    history: int
    mask_words: int
    max_rows: int
    spec_rows: int = 0


def rows_of(key: ForwardKey, sizes: Sizes) -> int:
    """R of a forward: T for a decode step, else min(T, ``max_rows``) (each row has a token),
    or min(T, ``spec_rows``) for a speculative step."""
    if key.decode:
        return key.tokens
    return min(key.tokens, sizes.spec_rows if key.spec else sizes.max_rows)


@functools.lru_cache(maxsize=1024)
def layout(group: str, shape: StepShape, sizes: Sizes) -> tuple[tuple[Field, tuple], ...]:
    """``((field, shape), ...)`` in buffer order of program ``group`` for a step of ``shape``
    (a pure function of its arguments: kept for the shapes last asked, as every step asks it
    for ``allocate`` and ``pack``)."""
    R, s = rows_of(shape.forward, sizes), shape.sampler
    d = dict(
        Q=(shape.forward.spec if group == "forward" else s.spec) + 1,
        T=shape.forward.tokens,
        R=R,
        R1=R + 1,
        M=shape.forward.pages or sizes.pages,
        Lh=sizes.history,
        E=s.bias,
        W=sizes.mask_words,
        J=len(s.processors),
        P=shape.prompt,
    )
    return tuple(
        (f, tuple(d[n] for n in f.shape)) for f in FIELDS if _present(f, group, s.level, s.spec)
    )


@dataclass(frozen=True)
class HostBatch:
    """A step's padded inputs: ``arrays`` (name -> array, also ``hb.tokens``) of ``shape``;
    host-only ``sample_rows`` bool[R] (the row's sampled token is real), ``pending_rows``
    bool[R] (its input token comes from the step in flight) and ``prompt_lp_rows`` i32[P] (the
    row of each scored prompt position, -1: padding)."""

    shape: StepShape
    sizes: Sizes
    arrays: dict
    sample_rows: np.ndarray
    pending_rows: np.ndarray
    prompt_lp_rows: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int32))

    def __getattr__(self, name):
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None

    rows = property(lambda self: len(self.sample_rows), doc="R, the padded row count.")


def allocate(shape: StepShape, sizes: Sizes) -> HostBatch:
    """An all-padding `HostBatch` of ``shape`` (each field at its ``pad``)."""
    arrays = {
        f.name: np.full(dims, f.pad, f.dtype)
        for group in ("forward", "sampling", "prompt")
        for f, dims in layout(group, shape, sizes)
    }
    R = rows_of(shape.forward, sizes)
    return HostBatch(
        shape,
        sizes,
        arrays,
        np.zeros((R,), bool),
        np.zeros((R,), bool),
        np.full((shape.prompt,), -1, np.int32),
    )


def pack(hb: HostBatch, group: str) -> np.ndarray:
    """``hb``'s fields of program ``group`` as one i32[S] (f32/u32 bit-cast). TypeError: an
    array that is not the schema's dtype and shape."""
    parts = []
    for f, dims in layout(group, hb.shape, hb.sizes):
        a = np.ascontiguousarray(hb.arrays[f.name])
        if a.dtype != f.dtype or a.shape != dims:
            raise TypeError(
                f"HostBatch.{f.name} is {a.dtype}{list(a.shape)}; the schema needs "
                f"{np.dtype(f.dtype)}{list(dims)}"
            )
        parts.append(a.view(np.int32).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2*lo, ...`` up to the first power >= hi, with ``hi`` itself as the last bucket."""
    return tuple(sorted({*(lo << i for i in range(hi.bit_length()) if lo << i < hi), hi}))


def geometric(lo: int, hi: int, dense_to: int) -> tuple[int, ...]:
    """Powers of two from ``lo`` up to ``dense_to``, then 1.5x and 2x steps (each power p gives
    p and 1.5p), ending at ``hi``: a bucket wastes at most a third of its size above
    ``dense_to``."""
    out, p = set(), lo
    while p < hi:
        out.add(p)
        if p >= dense_to and p * 3 // 2 < hi:
            out.add(p * 3 // 2)
        p *= 2
    return tuple(sorted(out | {hi}))


def default_batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Decode rows: powers of two to 64, then 1.5x and 2x steps, ending at ``max_num_seqs``."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    return geometric(1, max_num_seqs, 64)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Ragged tokens: powers of two from 32 to 1,024, then 1.5x and 2x steps, ending at the
    budget (at least 32)."""
    return geometric(32, max(32, max_num_batched_tokens), 1024)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Raises ValueError: ``n`` exceeds the largest bucket."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class BucketSpec:
    """Padded sizes: ``batch`` (decode rows, also the sampler's rows), ``tokens`` (ragged T),
    ``prompt`` (P scored prompt positions), the engine's fixed `Sizes`, ``pages`` (M
    buckets; empty: every forward's tables are `Sizes.pages` wide) of ``page_size`` tokens,
    and speculative decoding's ``spec`` k drafts a row at most (0: off) with ``spec_tokens``,
    the T buckets of its verify steps."""

    batch: tuple[int, ...]
    tokens: tuple[int, ...]
    prompt: tuple[int, ...]
    sizes: Sizes
    pages: tuple[int, ...] = ()
    page_size: int = 16
    spec: int = 0
    spec_tokens: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        page_size: int,
        vocab_size: int,
        batch_buckets: tuple[int, ...] = (),
        token_buckets: tuple[int, ...] = (),
        page_buckets: bool = False,
        spec: int = 0,
        spec_rows: int = 0,
    ) -> "BucketSpec":
        """``page_buckets``: forwards keyed by M too (powers of two), for the jnp reference
        attention, which gathers every page of its table (the kernels stop at each row's
        length, so M costs them nothing and their forwards are keyed by T alone). ``spec`` k
        and ``spec_rows``: verify steps of at most ``spec_rows`` rows (clipped to the largest
        row bucket), T from the power of two >= k + 1 up to the token budget."""
        tokens = token_buckets or default_token_buckets(max_num_batched_tokens)
        batch = batch_buckets or default_batch_buckets(max_num_seqs)
        M = -(-max_model_len // page_size)
        spec_rows = min(spec_rows, batch[-1]) if spec else 0
        sizes = Sizes(M, max_model_len, -(-vocab_size // 32), batch[-1], spec_rows)
        pages = powers_of_two(1, M) if page_buckets else ()
        lo = 1 << (spec).bit_length()  # the power of two above k, >= k + 1
        spec_tokens = geometric(lo, max(lo, tokens[-1]), 1024) if spec else ()
        prompt = powers_of_two(16, tokens[-1])
        return cls(batch, tokens, prompt, sizes, pages, page_size, spec, spec_tokens)

    def forward_keys(self) -> list[ForwardKey]:
        """Every forward shape: decode at each row bucket, ragged at each token bucket, verify
        steps at each ``spec_tokens`` bucket (each at every page bucket, if any)."""
        ms = self.pages or (0,)
        return (
            [ForwardKey(b, True, m) for b in self.batch for m in ms]
            + [ForwardKey(t, False, m) for t in self.tokens for m in ms]
            + [ForwardKey(t, False, m, self.spec) for t in self.spec_tokens for m in ms]
        )

    def sampler_rows(self, spec: int = 0) -> list[int]:
        """Every sampler row count the forwards with `ForwardKey.spec` ``spec`` produce."""
        return sorted({rows_of(k, self.sizes) for k in self.forward_keys() if k.spec == spec})

    def planned(self) -> dict[str, list]:
        """The whole set compiled before serving: {"forward": `ForwardKey`s, "sampler":
        `SamplerKey`s at every level (full with the first `BIAS_BUCKETS` entry, no
        processors) for the rows of every forward}. Prompt scorers and processors' samplers
        compile on first use."""
        samplers = [
            SamplerKey(r, lv, BIAS_BUCKETS[0] if lv == "full" else 0, (), k)
            for k in sorted({0, self.spec})
            for r in self.sampler_rows(k)
            for lv in LEVELS
        ]
        return dict(forward=self.forward_keys(), sampler=samplers)
