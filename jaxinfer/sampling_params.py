"""Per-request sampling parameters, vLLM's names and defaults (host side; imports no JAX)."""

import copy
import enum
import functools
import json as _json
import math
import numbers
from dataclasses import dataclass

from jaxinfer.checks import is_int

GREEDY_EPS = 1e-5  # temperatures below this are greedy (argmax; vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # most top log-probabilities per position (vLLM's default max_logprobs)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` returns for a request (vLLM's): CUMULATIVE: everything so far, each
    step it grows; DELTA: what is new since the last output; FINAL_ONLY: one output, at the end."""

    CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's names): exactly one of ``json`` (a JSON schema, a
    dict or its JSON text), ``regex`` (full match), ``choice`` (one of these strings), ``grammar``
    (Lark or GBNF, llguidance's syntax), ``json_object`` (True: any JSON object). Normalised:
    ``json`` to JSON text, ``choice`` to a tuple; ``key``: (kind, spec text), the grammar cache's.
    ValueError: none or several set, a value of the wrong type (named); a spec the grammar library
    rejects: at submission (`LLMEngine.check_request`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k, v in self.__dict__.items() if v is not None and v is not False]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of json, regex, choice, "
                f"grammar, json_object; got {given or 'none'}"
            )
        k, v = given[0], getattr(self, given[0])
        if k == "json" and isinstance(v, dict):
            object.__setattr__(self, "json", v := _json.dumps(v))
        if k == "choice" and isinstance(v, (list, tuple)):
            object.__setattr__(self, "choice", v := tuple(v))
        ok = (
            v is True
            if k == "json_object"
            else isinstance(v, tuple) and v and all(isinstance(c, str) and c for c in v)
            if k == "choice"
            else isinstance(v, str)
        )
        if not ok:
            raise ValueError(
                f"StructuredOutputsParams.{k}={v!r} is invalid: must be "
                + dict(
                    json="a dict or a JSON string",
                    choice="a non-empty list of non-empty strings",
                    json_object="True",
                ).get(k, "a string")
            )
        object.__setattr__(self, "key", (k, _json.dumps(list(v)) if k == "choice" else str(v)))


_int = functools.partial(is_int, numpy=True)  # (v, lo=None): a Python or NumPy int, not a bool


def _real(ok):
    return lambda v: (
        isinstance(v, numbers.Real)
        and not isinstance(v, bool)
        and not math.isnan(v)
        and ok(float(v))
    )


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


_RULES = (  # field, valid(value), what is allowed, normalise
    (
        "temperature",
        _real(lambda t: 0.0 <= t < math.inf),
        f"must be a finite number >= 0 (< {GREEDY_EPS:g} means greedy)",
        float,
    ),
    ("top_p", _real(lambda p: 0.0 < p <= 1.0), "must be in (0, 1]", float),
    ("min_p", _real(lambda p: 0.0 <= p <= 1.0), "must be in [0, 1]", float),
    (
        "repetition_penalty",
        _real(lambda r: 0.0 < r < math.inf),
        "must be a finite number > 0 (1 = off)",
        float,
    ),
    *(
        (name, _real(lambda x: -2.0 <= x <= 2.0), "must be in [-2, 2] (0 = off)", float)
        for name in ("presence_penalty", "frequency_penalty")
    ),
    (
        "top_k",
        lambda k: _int(k, -1),
        "must be -1 or 0 (off) or an integer >= 1",
        lambda k: int(k) if k > 0 else -1,
    ),
    (
        "seed",
        lambda s: s is None or _int(s) and -(2**63) <= s < 2**63,
        "must be None or an integer in [-2**63, 2**63 - 1]",
        _opt_int,
    ),
    (
        "max_tokens",
        lambda m: m is None or _int(m, 1),
        "must be None (up to max_model_len) or an integer >= 1",
        _opt_int,
    ),
    ("min_tokens", lambda m: _int(m, 0), "must be an integer >= 0", int),
    (
        "stop",
        lambda s: (
            s is None
            or isinstance(s, str)
            and s
            or isinstance(s, (list, tuple))
            and all(isinstance(x, str) and x for x in s)
        ),
        "must be None, a non-empty string or a list/tuple of non-empty strings",
        lambda s: () if s is None else (s,) if isinstance(s, str) else tuple(s),
    ),
    (
        "stop_token_ids",
        lambda ids: ids is None or isinstance(ids, (list, tuple)) and all(_int(t, 0) for t in ids),
        "must be None or a list/tuple of integers >= 0",
        lambda ids: tuple(int(t) for t in ids or ()),
    ),
    *(
        (
            name,
            lambda v, ok=ok: v is None or isinstance(v, (list, tuple)) and all(map(ok, v)),
            f"must be None or a list of {what}",
            lambda v: v and list(v),
        )
        for name, ok, what in (
            ("bad_words", lambda w: isinstance(w, str) and w, "non-empty strings"),
            ("logits_processors", callable, "callables"),
        )
    ),
    (
        "allowed_token_ids",
        lambda v: (
            v is None or isinstance(v, (list, tuple)) and len(v) > 0 and all(_int(t, 0) for t in v)
        ),
        "must be None or a non-empty list of integers >= 0",
        lambda v: v and list(v),
    ),
    (
        "truncate_prompt_tokens",
        lambda k: k is None or k == -1 and _int(k) or _int(k, 1),
        "must be None, -1 (max_model_len) or an integer >= 1 (keep the last k prompt tokens)",
        _opt_int,
    ),
    (
        "extra_args",
        lambda a: a is None or isinstance(a, dict),
        "must be None or a dict",
        lambda a: a,
    ),
    ("n", lambda n: _int(n, 1), "must be an integer >= 1", int),
    (
        "logit_bias",
        lambda b: (
            b is None
            or isinstance(b, dict)
            and all(
                (_int(t, 0) or isinstance(t, str) and t.isdecimal()) and _real(math.isfinite)(x)
                for t, x in b.items()
            )
        ),
        "must be None or a dict {token id (int >= 0, or its decimal string): finite number}",
        lambda b: {int(t): min(100.0, max(-100.0, float(x))) for t, x in (b or {}).items()},
    ),
    *(
        (
            name,
            lambda k: k is None or _int(k, 0) and k <= MAX_LOGPROBS,
            f"must be None or an integer in [0, {MAX_LOGPROBS}]",
            _opt_int,
        )
        for name in ("logprobs", "prompt_logprobs")
    ),
    *(
        (name, lambda b: isinstance(b, bool), "must be a bool", bool)
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        )
    ),
    (
        "structured_outputs",
        lambda s: s is None or isinstance(s, StructuredOutputsParams),
        "must be None or a StructuredOutputsParams",
        lambda s: s,
    ),
    (
        "output_kind",
        lambda k: isinstance(k, RequestOutputKind),
        f"must be a RequestOutputKind ({', '.join(k.name for k in RequestOutputKind)})",
        lambda k: k,
    ),
)


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's names, defaults and meanings; allowed
    values and normalisation: `_RULES`). min_p: keep tokens of probability >= min_p x the top one.
    repetition_penalty: divides positive, multiplies negative logits of prompt or output ids.
    presence / frequency_penalty: subtract ``presence x [count > 0] + frequency x count`` (output
    tokens). seed None: the engine draws one (a seeded request's tokens do not depend on its batch).
    min_tokens: EOS and ``stop_token_ids`` masked until this many. stop: strings ending generation,
    left out of the text unless ``include_stop_str_in_output``. stop_token_ids: finish "stop", even
    with ``ignore_eos``. n: samples, sample i seeded by (seed, i). logprobs / prompt_logprobs k: the
    chosen token's raw log-probability and the top k (of the masked logits on constrained rows).
    structured_outputs: the output's grammar (ends on EOS, finish "stop"). detokenize False: ids, no
    text. extra_args: kept for the caller. allowed_token_ids: only these sampled; bad_words: never
    generated (`StructuredOutputManager.fill`, vLLM V1's); logits_processors: JAX
    ``fn(output_token_ids, logits) -> logits`` (`runner.sampling`). Mutable (vLLM's): validated here
    and at each submission (`LLMEngine.check_request`). ValueError: a bad value."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    extra_args: dict | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list | None = None

    def __post_init__(self) -> None:
        for name, ok, allowed, norm in _RULES:
            v = getattr(self, name)
            if not ok(v):
                raise ValueError(f"SamplingParams.{name}={v!r} is invalid: {allowed}")
            setattr(self, name, norm(v))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens={self.min_tokens} is invalid: must be <= "
                f"max_tokens={self.max_tokens}"
            )
        if self.stop and not self.detokenize:
            raise ValueError(
                f"SamplingParams.stop={list(self.stop)!r} is invalid with "
                "detokenize=False: stop strings are matched in the text"
            )

    clone = copy.deepcopy  # vLLM's ``clone``: a deep copy

    needs_history = property(
        lambda self: (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logits_processors)
        ),
        doc="A penalty or a logits processor reads the row's tokens (the step waits for the last).",
    )

    greedy = property(lambda self: self.temperature < GREEDY_EPS, doc="The token is the argmax.")


@dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s parameters (vLLM's names, defaults, meanings): ``beam_width`` beams,
    each proposing ``2 * beam_width`` tokens a step (<= `MAX_LOGPROBS`), for ``max_tokens``
    steps; ``length_penalty``: the exponent of the score's length. ValueError: a bad value."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        rules = {
            "beam_width": (
                lambda w: _int(w, 1) and 2 * w <= MAX_LOGPROBS,
                f"an integer in [1, {MAX_LOGPROBS // 2}]",
            ),
            "max_tokens": (lambda m: _int(m, 1), "an integer >= 1"),
            "temperature": (_real(lambda t: 0 <= t < math.inf), "a finite number >= 0"),
            "length_penalty": (_real(math.isfinite), "a finite number"),
        }
        for name, value in self.__dict__.items():
            ok, allowed = rules.get(name, (lambda b: isinstance(b, bool), "a bool"))
            if not ok(value):
                raise ValueError(f"BeamSearchParams.{name}={value!r} is invalid: must be {allowed}")
