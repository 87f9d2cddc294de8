"""Per-request sampling parameters, vLLM's names and defaults (host side; imports no JAX)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (argmax), vLLM's ``_SAMPLING_EPS``: dividing bf16 logits by
a tiny temperature overflows, so the device step must not divide by it."""
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's names and defaults).

    Fields:
        temperature: >= 0; below `GREEDY_EPS` the request is greedy (argmax).
        top_p: nucleus sampling mass in (0, 1], 1 = off (Holtzman et al. 2019); the most likely
            token is always kept.
        top_k: keep the ``top_k`` most likely tokens; -1 = off, else >= 1.
        min_p: keep tokens with probability >= min_p x the top probability; in [0, 1], 0 = off.
        repetition_penalty: > 0, 1 = off; every token id of the prompt or output so far has a
            positive logit divided by it, a negative one multiplied (HF / vLLM; Keskar et al. 2019).
        seed: any int64, or None (the engine draws one). A seeded request's tokens do not depend on
            its batch; the sampler keys on ``seed ^ (seed >> 32)`` folded to uint32.
        max_tokens: the most tokens to generate, >= 1.
        stop: strings that end generation (matched on the decoded text, left out of it); a str or
            a list, normalised to a tuple of non-empty strings.
        stop_token_ids: ids that end generation (finish "stop"), even with ``ignore_eos``.
        ignore_eos: keep generating past the model's EOS ids (until ``max_tokens``).
        skip_special_tokens: drop special tokens when decoding the output text.
        n: outputs per request; only 1 (submit a prompt n times with different seeds instead).

    Raises:
        ValueError: a field out of range or of the wrong type (naming the field, the value and
            what is allowed).
    """

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
        def real(name: str, ok, allowed: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or math.isnan(v) \
                    or not ok(float(v)):
                _fail(name, v, allowed)
            object.__setattr__(self, name, float(v))

        real("temperature", lambda t: 0.0 <= t < math.inf, "must be a finite number >= 0 "
             f"(< {GREEDY_EPS:g} means greedy)")
        real("top_p", lambda p: 0.0 < p <= 1.0, "must be in (0, 1]")
        real("min_p", lambda p: 0.0 <= p <= 1.0, "must be in [0, 1]")
        real("repetition_penalty", lambda r: 0.0 < r < math.inf, "must be a finite number > 0 "
             "(1 = off)")

        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            _fail("top_k", self.top_k, "must be -1 (off) or an integer >= 1")
        object.__setattr__(self, "top_k", int(self.top_k))

        if self.seed is not None:
            if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX:
                _fail("seed", self.seed, "must be None or an integer in [-2**63, 2**63 - 1]")
            object.__setattr__(self, "seed", int(self.seed))

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", self.stop, "must be a non-empty string or a list/tuple of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))

        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            _fail("stop_token_ids", ids, "must be a list/tuple of integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

        if not _is_int(self.n) or self.n != 1:
            _fail("n", self.n, "only n=1 is supported (parallel sampling is not implemented; "
                  "submit the prompt n times with different seeds)")

        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a bool")

    @property
    def greedy(self) -> bool:
        """``temperature < GREEDY_EPS``: the token is the argmax."""
        return self.temperature < GREEDY_EPS
