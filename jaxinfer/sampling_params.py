"""Per-request sampling parameters (host side; imports no JAX).

Names and defaults follow vLLM's ``SamplingParams`` so that users can move between the two. The
dataclass is frozen and validated at construction: a bad value raises ``ValueError`` naming the
field, the value and the allowed range, e.g.
``SamplingParams.top_p=0 is invalid: must be in (0, 1]``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (argmax), vLLM's ``_SAMPLING_EPS``: dividing bf16 logits by
a tiny temperature overflows, so the device step must not divide by it."""

_INT64_MIN = -(2 ** 63)
_INT64_MAX = 2 ** 63 - 1


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM names and defaults).

    Fields:
        temperature: softmax temperature, >= 0. Below ``GREEDY_EPS`` (1e-5) the request is
            greedy (argmax); see the ``greedy`` property.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability sum reaches
            ``top_p``; in (0, 1], 1 = off. (Holtzman et al. 2019, "The Curious Case of Neural Text
            Degeneration".) The most likely token is always kept.
        top_k: keep the ``top_k`` most likely tokens; -1 = off, otherwise >= 1 (0 is rejected:
            it would leave no candidate, CASES.md C5).
        min_p: keep tokens whose probability is >= ``min_p`` x the top probability; in [0, 1],
            0 = off.
        repetition_penalty: > 0, 1 = off. Applied to every token id that occurs in the prompt or
            the output so far, as in HF ``RepetitionPenaltyLogitsProcessor`` / vLLM: a positive
            logit is divided by it, a negative one multiplied (Keskar et al. 2019, CTRL).
        seed: per-request random seed (any int64), or ``None`` (the engine draws one). A seeded
            request's tokens do not depend on the batch it runs in (CASES.md C7). The sampler
            keys on 32 bits, ``seed ^ (seed >> 32)`` folded to uint32, so seeds that fold to the
            same value (e.g. 0 and 2**32 + 1) sample the same tokens.
        max_tokens: the most tokens to generate, >= 1.
        stop: strings that end generation when they appear in the decoded output (matched by the
            engine on text; the stop string is not included in the output). A single ``str`` or a
            list is accepted and normalised to a tuple of non-empty strings.
        stop_token_ids: token ids that end generation (finish reason "stop"), even with
            ``ignore_eos``. A list is accepted and normalised to a tuple of ints >= 0.
        ignore_eos: keep generating past the model's EOS ids (until ``max_tokens``).
        skip_special_tokens: drop special tokens when decoding the output text.
        n: output sequences per request; only 1 is supported (vLLM's parallel sampling of
            several outputs per prompt is not implemented: submit the prompt n times with
            different seeds instead).

    Raises:
        ValueError: a field out of range or of the wrong type; the message names the field, the
            value and what is allowed.
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
            if not _is_real(v) or math.isnan(v) or not ok(float(v)):
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
        """True when ``temperature < 1e-5``: the token is the argmax (no random draw)."""
        return self.temperature < GREEDY_EPS
