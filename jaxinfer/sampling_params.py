"""Per-request sampling parameters, vLLM's names and defaults (host side; imports no JAX)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

GREEDY_EPS = 1e-5  # temperatures below this are greedy (argmax; vLLM's _SAMPLING_EPS)


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(ok):
    return lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v) \
        and ok(float(v))


_RULES = (  # field, valid(value), what is allowed, normalise
    ("temperature", _real(lambda t: 0.0 <= t < math.inf),
     f"must be a finite number >= 0 (< {GREEDY_EPS:g} means greedy)", float),
    ("top_p", _real(lambda p: 0.0 < p <= 1.0), "must be in (0, 1]", float),
    ("min_p", _real(lambda p: 0.0 <= p <= 1.0), "must be in [0, 1]", float),
    ("repetition_penalty", _real(lambda r: 0.0 < r < math.inf),
     "must be a finite number > 0 (1 = off)", float),
    ("top_k", lambda k: _int(k) and (k == -1 or k >= 1), "must be -1 (off) or an integer >= 1", int),
    ("seed", lambda s: s is None or _int(s) and -2 ** 63 <= s < 2 ** 63,
     "must be None or an integer in [-2**63, 2**63 - 1]", lambda s: s if s is None else int(s)),
    ("max_tokens", lambda m: _int(m) and m >= 1, "must be an integer >= 1", int),
    ("stop", lambda s: isinstance(s, str) and s or isinstance(s, (list, tuple)) and all(
        isinstance(x, str) and x for x in s),
     "must be a non-empty string or a list/tuple of non-empty strings",
     lambda s: (s,) if isinstance(s, str) else tuple(s)),
    ("stop_token_ids", lambda ids: isinstance(ids, (list, tuple)) and all(
        _int(t) and t >= 0 for t in ids), "must be a list/tuple of integers >= 0",
     lambda ids: tuple(int(t) for t in ids)),
    ("n", lambda n: _int(n) and n == 1, "only n=1 is supported (parallel sampling is not "
     "implemented; submit the prompt n times with different seeds)", int),
    *((name, lambda b: isinstance(b, bool), "must be a bool", bool)
      for name in ("ignore_eos", "skip_special_tokens")),
)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's names and defaults). temperature: >= 0;
    below `GREEDY_EPS` greedy. top_p: nucleus mass in (0, 1], 1 = off (the likeliest token is
    kept). top_k: -1 = off, else >= 1. min_p: keep tokens of probability >= min_p x the top one;
    [0, 1], 0 = off. repetition_penalty: > 0, 1 = off; divides the positive and multiplies the
    negative logits of token ids in the prompt or output (HF / vLLM). seed: int64 or None (the
    engine draws one); a seeded request's tokens do not depend on its batch. max_tokens: >= 1.
    stop: strings that end generation, left out of the text (str or list; stored as a tuple).
    stop_token_ids: ids that end generation (finish "stop"), even with ``ignore_eos``.
    ignore_eos: generate past EOS. skip_special_tokens: when decoding. n: only 1. Raises
    ValueError naming the field, the value and what is allowed."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        for name, ok, allowed, norm in _RULES:
            v = getattr(self, name)
            if not ok(v):
                raise ValueError(f"SamplingParams.{name}={v!r} is invalid: {allowed}")
            object.__setattr__(self, name, norm(v))

    @property
    def greedy(self) -> bool:
        """``temperature < GREEDY_EPS``: the token is the argmax."""
        return self.temperature < GREEDY_EPS
