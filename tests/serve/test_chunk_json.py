"""The JSON of responses and stream chunks (`OpenAIServing.dump`, msgspec) is what pydantic gives
for the ``openai`` package's types, built unvalidated with the same fields (the reference), and
the official client's types parse it. A -inf log-probability (a masked token) is sent as -9999.0,
as vLLM's ``serving_chat.py`` clamps it (JSON has no infinity)."""

import itertools
import json
import typing

from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from jaxinfer.serve import protocol as P
from jaxinfer.serve.completions import OpenAIServing


class _Out:  # a `CompletionOutput` whose one token had probability 0
    logprobs = [{}]

    @staticmethod
    def top_logprobs(k):
        return [("a", float("-inf"), [("a", float("-inf"))])]


def _pydantic(cls, serving, rid, choices, usage, created):
    obj = typing.get_args(cls.model_fields["object"].annotation)[0]
    usage = usage and CompletionUsage.model_construct(**usage)
    return json.loads(
        cls.model_construct(
            id=rid,
            object=obj,
            created=created,
            choices=choices,
            model=serving.model_name,
            usage=usage,
        ).model_dump_json(exclude_unset=True)
    )


def test_dump_matches_pydantic_and_parses():
    serving = OpenAIServing(None, "bench", itertools.count())
    lp = P.chat_logprobs(_Out(), 1)
    assert lp["content"][0]["logprob"] == -9999.0
    assert P.completion_logprobs(_Out(), 1)["token_logprobs"] == [-9999.0]
    assert P.completion_logprobs(_Out(), 1)["top_logprobs"] == [{"a": -9999.0}]
    cases = [
        (
            ChatCompletionChunk,
            [
                dict(
                    index=3,
                    delta=dict(role=None, content=" hi", tool_calls=None),
                    logprobs=lp,
                    finish_reason=None,
                )
            ],
            None,
        ),
        (
            ChatCompletion,
            [
                dict(
                    index=0,
                    message=dict(role="assistant", content="x", tool_calls=None),
                    logprobs=None,
                    finish_reason="abort",
                    stop_reason=None,
                )
            ],
            dict(prompt_tokens=3, completion_tokens=1, total_tokens=4),
        ),
        (
            Completion,
            [dict(index=1, text="t", logprobs=None, finish_reason="length", stop_reason=None)],
            dict(prompt_tokens=1, completion_tokens=2, total_tokens=3),
        ),
    ]
    for cls, choices, usage in cases:
        got = json.loads(serving.dump(cls, "id-1", choices, usage))
        assert got == _pydantic(cls, serving, "id-1", choices, usage, got["created"]), cls
        cls.model_validate(
            got
            if cls is not ChatCompletion
            else {**got, "choices": [dict(c, finish_reason="stop") for c in got["choices"]]}
        )
    assert got["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
