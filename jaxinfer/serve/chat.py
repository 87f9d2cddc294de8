"""``POST /v1/chat/completions`` (vLLM's ``serving_chat.py``): the messages in the model's chat
template; logprobs with ``logprobs`` + ``top_logprobs``; a stream opens with the assistant role.
A forced tool call (``tool_choice``) comes back as ``tool_calls`` (OpenAI's shape, vLLM's
finish reasons: "stop" for a named function, "tool_calls" for "required"). vLLM's extras:
``prompt_logprobs`` (the response's field of that name, not streamed) and ``echo`` (the last
message's content before the reply's, if the last message is the assistant's)."""

import json
import uuid

from fastapi import Request
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from jaxinfer.serve import protocol as P
from jaxinfer.serve.completions import OpenAIServing
from jaxinfer.serve.errors import APIError


def _call(name: str | None, arguments: str, index: int | None = None) -> dict:
    """A tool call; streamed: ``index``, and ``id``, ``type``, ``name`` in the first delta only."""
    call = dict(
        id=name and f"call_{uuid.uuid4().hex[:24]}",
        type=name and "function",
        function=dict(name=name, arguments=arguments),
    )
    return call if index is None else dict(call, index=index)


class ServingChat(OpenAIServing):
    prefix, Response, Chunk = "chatcmpl", ChatCompletion, ChatCompletionChunk

    async def create(self, body: P.ChatCompletionRequest, request: Request):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if body.stream and body.tool_choice == "required":
            raise APIError(
                'tool_choice="required" is not supported with stream=true', param="tool_choice"
            )
        self.check_logprobs(body, ("prompt_logprobs",))
        most = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        sp = self.sampling_params(body, most, (body.top_logprobs or 0) if body.logprobs else None)
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        tools = body.tools and [t.model_dump() for t in body.tools]
        chat = self.client.prompts.apply_chat_template
        _, prompts = await self.encode(
            lambda: {"prompt_token_ids": chat(msgs, tools)}, sp, "messages"
        )
        return await self.respond(request, body, prompts, sp, "messages")

    @staticmethod
    def echoed(body: P.ChatCompletionRequest) -> str:
        """What ``echo`` puts before each reply: the last message's text if it is the
        assistant's (the role replying), else ""."""
        last = body.messages[-1]
        return last.text() if body.echo and last.role == "assistant" else ""

    def opening(self, n: int, body) -> list[dict]:
        delta = dict(role="assistant", content=self.echoed(body))
        return [dict(index=i, delta=delta, logprobs=None, finish_reason=None) for i in range(n)]

    def fields(self, body, outs: list) -> dict:
        return dict(prompt_logprobs=P.prompt_logprobs(outs[0]))

    def choice(
        self, index: int, req, out, k: int | None, offset=None, stream: bool = False, body=None
    ):
        tool, reason = body.tool_choice, out.finish_reason
        msg = dict(role=None if stream else "assistant", content=out.text, tool_calls=None)
        if isinstance(tool, P.Tool):  # one named function: the text is its arguments
            name = None if offset else tool.function.name
            msg.update(content=None, tool_calls=[_call(name, out.text, 0 if stream else None)])
        elif tool == "required" and reason == "stop" and out.stop_reason is None:  # on EOS
            reason = "tool_calls"
            msg.update(
                content=None,
                tool_calls=[
                    _call(c["name"], json.dumps(c["parameters"])) for c in json.loads(out.text)
                ],
            )
        choice = dict(index=index, logprobs=P.chat_logprobs(out, k), finish_reason=reason)
        if stream:
            return dict(choice, delta=msg)
        if echo := self.echoed(body):
            msg["content"] = echo + (msg["content"] or "")
        return dict(choice, message=msg, stop_reason=out.stop_reason)
