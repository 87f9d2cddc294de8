"""Request bodies of the OpenAI API (pydantic; OpenAI's and vLLM's ``protocol.py`` field names and
defaults) and logprobs from `Logprob` records; responses are the ``openai`` package's types. Host
side, no JAX."""

import dataclasses
import itertools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from jaxinfer.outputs import CompletionOutput
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):  # also "name", "description", "strict": accepted, unused
    model_config = ConfigDict(populate_by_name=True)
    json_schema: dict | None = Field(None, alias="schema")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


_SHARED = (
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)  # type, default
_SamplingFields = create_model(
    "_SamplingFields",
    **{
        f.name: (f.type, f.default) for f in dataclasses.fields(SamplingParams) if f.name in _SHARED
    },
)


class _Sampling(_SamplingFields):
    """The sampling fields both endpoints share (`_SHARED`: `SamplingParams`' type and
    default); `sampling_params` validates the values. Unknown fields are kept in
    ``model_extra`` (vLLM ignores them with a logged warning; so does the server)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's extra body: StructuredOutputsParams' fields
    prompt_logprobs: int | None = None  # vLLM's extra body: top k per prompt token (not streamed)

    def constraint(self) -> str:
        """The field an invalid output constraint is reported under (OpenAI's ``param``)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured(self) -> StructuredOutputsParams | None:
        """The output's constraint: ``structured_outputs``, else ``response_format``'s."""
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown field
                raise ValueError(f"structured_outputs is invalid: {e}") from None
        if (rf := self.response_format) is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise ValueError("response_format.json_schema.schema is required with json_schema")
        return StructuredOutputsParams(json=rf.json_schema.json_schema)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, **override
    ) -> SamplingParams:
        """The `SamplingParams` fields this body shares by name, ``override`` (fields) last;
        raises ValueError (naming one)."""
        own = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SamplingParams)
            if f.name in type(self).model_fields
        }
        return SamplingParams(
            **dict(
                own,
                temperature=1.0 if self.temperature is None else self.temperature,
                stop_token_ids=self.stop_token_ids or [],
                max_tokens=max_tokens,
                logprobs=logprobs,
                structured_outputs=self.structured(),
                **override,
            )
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string, a list of strings, token ids or lists of them;
    ``echo``: each choice's text and logprobs start with its prompt's (vLLM's: ``max_tokens`` 0
    with echo returns the prompt alone)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False  # vLLM's Optional: null is False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    """A message content part: text only (the models served are text-only, so an image or audio
    part is a 400, as vLLM answers for a text-only model)."""

    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(
                f"content part type {v!r} is not supported: the model takes text only ('text')"
            )
        return v


class ChatMessage(BaseModel):
    role: Literal["developer", "system", "user", "assistant", "tool"]  # OpenAI's (vLLM takes them)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The content; a list of parts: its "text" parts joined."""
        c = self.content
        return "".join(p.text for p in c if p.type == "text") if isinstance(c, list) else c or ""


class Function(BaseModel):
    name: str = Field(min_length=1)  # "": the forced call's id and type were "" (a 500)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (the model's chat template, ``tools`` passed to it).
    ``tool_choice`` {"type": "function", "function": {"name"}} or "required" constrains the output
    (`tool_schema`); "none" (or no tools) leaves it free."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | Tool | None = None
    echo: bool = False  # vLLM's: the last message's content first, if it is the assistant's

    def tool_schema(self) -> dict | None:
        """The JSON schema of a forced tool call (vLLM's): the named function's parameters, or
        for "required" an array (>= 1) of {"name", "parameters"} of any tool; None: no constraint.
        ValueError: an unknown name, "auto" (no tool parser), or "required" without tools."""
        choice, tools = self.tool_choice, {t.function.name: t.function for t in self.tools or ()}
        if choice in (None, "none") and (choice == "none" or not tools):
            return None
        if isinstance(choice, Tool):
            if (name := choice.function.name) not in tools:
                raise ValueError(
                    f"tool_choice names function {name!r}, not one of tools {sorted(tools)}"
                )
            return tools[name].parameters or {"type": "object", "properties": {}}
        if choice != "required" or not tools:
            raise ValueError(
                f"tool_choice={choice!r} is not supported: name a function in "
                'tool_choice, or use "required" (with tools) or "none"'
            )
        return {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"enum": [f.name]},
                            "parameters": f.parameters or {"type": "object", "properties": {}},
                        },
                    }
                    for f in tools.values()
                ]
            },
        }

    def constraint(self) -> str:
        return "tool_choice" if self.tool_choice not in (None, "none") else super().constraint()

    def structured(self) -> StructuredOutputsParams | None:
        schema = self.tool_schema()
        return super().structured() if schema is None else StructuredOutputsParams(json=schema)


_lp = lambda x: max(x, -9999.0)  # noqa: E731 JSON has no -inf: vLLM sends a masked token's -9999.0


Row = tuple[str, float | None, list[tuple[str, float]] | None]  # as `CompletionOutput.top_logprobs`


def completion_logprobs(out, k: int | None, offset: int = 0) -> dict | None:
    """``out``'s top-``k`` logprobs (OpenAI completions), text from ``offset``; None: not asked."""
    if k is None or out.logprobs is None:
        return None
    return rows_logprobs(out.top_logprobs(k), offset)


def rows_logprobs(rows: list[Row], offset: int = 0) -> dict:
    """OpenAI completions' logprobs object of ``rows``, text from ``offset``; a row without a
    log-probability (a prompt's first token) has null ``token_logprobs`` and ``top_logprobs``."""
    return dict(
        text_offset=list(itertools.accumulate((len(s) for s, *_ in rows[:-1]), initial=offset))[
            : len(rows)
        ],
        tokens=[s for s, *_ in rows],
        token_logprobs=[None if lp is None else _lp(lp) for _, lp, _ in rows],
        top_logprobs=[None if top is None else {s: _lp(x) for s, x in top} for *_, top in rows],
    )


def prompt_rows(req, k: int, decode) -> list[Row]:
    """The `Row`s of ``req``'s (a `RequestOutput`'s) prompt tokens with their top ``k``
    (``req.prompt_logprobs``); the first, which has no log-probability: (``decode([its id])``,
    None, None), vLLM's."""
    ids, recs = req.prompt_token_ids, req.prompt_logprobs or [None]
    rest = CompletionOutput(0, "", ids[1:], None, logprobs=recs[1:]).top_logprobs(k)
    return [(decode(ids[:1]), None, None), *rest]


def prompt_logprobs(req) -> list[dict | None] | None:
    """``req.prompt_logprobs`` as vLLM's response field: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}}; None: not asked."""
    if req.prompt_logprobs is None:
        return None
    return [
        None
        if rec is None
        else {
            str(t): dict(logprob=_lp(x.logprob), rank=x.rank, decoded_token=x.decoded_token)
            for t, x in rec.items()
        }
        for rec in req.prompt_logprobs
    ]


def chat_logprobs(out, k: int | None) -> dict | None:
    """As `completion_logprobs`, in the chat endpoint's shape."""
    if k is None or out.logprobs is None:
        return None

    def entry(s: str, lp: float, **kw) -> dict:
        return dict(token=s, logprob=_lp(lp), bytes=list(s.encode("utf-8", "replace")), **kw)

    return {
        "content": [
            entry(s, lp, top_logprobs=[entry(*x) for x in top])
            for s, lp, top in out.top_logprobs(k)
        ]
    }
