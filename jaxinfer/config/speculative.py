"""`SpeculativeConfig`: speculative decoding's settings, with vLLM's ``speculative_config`` keys and
meanings (vLLM's ``vllm/config/speculative.py``); `SpeculativeConfig.from_value` reads the forms
users give it (a dict, the CLI's JSON string). No JAX."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxinfer.checks import is_int
from jaxinfer.config.model import _check, _fail

METHODS = ("ngram", "draft_model", "eagle3")
NGRAM_LOOKUP_DEFAULT = 5  # vLLM's prompt_lookup_min and _max when neither is given
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


def _optional_int(lo: int):
    return lambda v: v is None or is_int(v, lo)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step a row proposes up to ``num_speculative_tokens`` draft
    tokens, the model verifies them in one forward and keeps the longest accepted prefix plus one
    token of its own (the output equals decoding without drafts).

    ``method``: "ngram" (drafts copied from where the last n tokens occurred earlier in the
    prompt and output; no model), "draft_model" (a smaller model of the same tokenizer at
    ``model``) or "eagle3" (an EAGLE-3 head at ``model``); None: "draft_model" when ``model`` is
    given, else an error. ``num_speculative_tokens``: k >= 1, required. ``model``: a local file or
    directory, required by "draft_model" and "eagle3", refused by "ngram".
    ``prompt_lookup_max`` / ``prompt_lookup_min``: "ngram" only, the longest and shortest n-gram
    matched (>= 1, min <= max); vLLM's defaults: both missing -> 5 and 5, one missing -> the
    other's value. ``disable_by_batch_size``: speculation is off for a step with more running rows
    than this (>= 1); None: the engine decides. ``draft_tensor_parallel_size`` (vLLM's): None or 1,
    the draft runs on one device. Construction validates and normalises; ValueError names the
    field, the value and what is allowed."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        _check(
            self,
            (
                (
                    "method",
                    (None, *METHODS).__contains__,
                    "allowed: " + ", ".join(map(repr, METHODS)) + " (None: 'draft_model' "
                    "when model is given)",
                ),
                ("model", lambda v: v is None or isinstance(v, (str, os.PathLike)), "a path"),
                (
                    "num_speculative_tokens",
                    lambda v: is_int(v, 1),
                    "must be an integer >= 1 (required: the draft tokens per row and step)",
                ),
                *(
                    (name, _optional_int(1), "must be None or an integer >= 1")
                    for name in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
                ),
                (
                    "draft_tensor_parallel_size",
                    lambda v: v is None or is_int(v, 1) and v == 1,
                    "must be None or 1 (the draft runs on one device)",
                ),
            ),
        )
        if self.model is not None:
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.method is None:
            if self.model is None:
                _fail(
                    "SpeculativeConfig",
                    "method",
                    None,
                    "give method (" + ", ".join(map(repr, METHODS)) + ") or model "
                    "(a draft model: method 'draft_model')",
                )
            object.__setattr__(self, "method", "draft_model")
        (self._check_ngram if self.method == "ngram" else self._check_model)()

    def _check_ngram(self) -> None:
        """Method "ngram": no model; vLLM's defaulting of the lookup bounds, then min <= max."""
        if self.model is not None:
            _fail(
                "SpeculativeConfig",
                "model",
                self.model,
                "method 'ngram' drafts from the request's own tokens and takes no model",
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = NGRAM_LOOKUP_DEFAULT
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            _fail(
                "SpeculativeConfig",
                "prompt_lookup_min",
                lo,
                f"must be <= prompt_lookup_max={hi}",
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_model(self) -> None:
        """Methods "draft_model" and "eagle3": an existing local model path; no n-gram bounds."""
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                _fail(
                    "SpeculativeConfig",
                    name,
                    getattr(self, name),
                    f"applies to method 'ngram' only (method is {self.method!r}); remove it",
                )
        if self.model is None:
            _fail(
                "SpeculativeConfig",
                "model",
                None,
                f"method {self.method!r} needs model: a local draft model directory or file",
            )
        if not (os.path.isdir(self.model) or os.path.isfile(self.model)):
            _fail(
                "SpeculativeConfig",
                "model",
                self.model,
                "no such local directory or file (nothing is downloaded)",
            )

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """``value`` as a `SpeculativeConfig`: None -> None; a `SpeculativeConfig` -> itself; a
        dict of its fields; a str holding a JSON object of them (the CLI's and the server's
        ``--speculative-config``). ValueError: a str that is not JSON or not an object (the value
        named), unknown keys (named, the allowed ones listed), any other type, a bad field."""
        if value is None or isinstance(value, cls):
            return value
        given = value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"speculative_config={given!r} is not valid JSON ({e.msg} at column "
                    f"{e.colno}); give an object, e.g. '{EXAMPLE}'"
                ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config={given!r} is invalid: must be None, a dict, a JSON object "
                f"(e.g. '{EXAMPLE}') or a SpeculativeConfig"
            )
        allowed = [f.name for f in dataclasses.fields(cls)]
        if unknown := [k for k in value if k not in allowed]:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(allowed)}"
            )
        return cls(**value)
