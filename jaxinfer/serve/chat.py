"""``POST /v1/chat/completions`` (vLLM's ``serving_chat.py``): the messages in the model's chat
template; logprobs with ``logprobs`` + ``top_logprobs``; a stream opens with the assistant role."""

from fastapi import Request

from jaxinfer.serve import protocol as P
from jaxinfer.serve.completions import OpenAIServing
from jaxinfer.serve.errors import APIError


class ServingChat(OpenAIServing):
    prefix, Response, Chunk = "chatcmpl", P.ChatCompletionResponse, P.ChatCompletionChunk

    async def create(self, body: P.ChatCompletionRequest, request: Request):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        sp = self.sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                  (body.top_logprobs or 0) if body.logprobs else None)
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        chat = self.client.prompts.apply_chat_template
        prompts = await self.encode(lambda: {"prompt_token_ids": chat(msgs)}, sp, "messages")
        return await self.respond(request, body, prompts, sp, "messages")

    def opening(self, n: int) -> list[P.ChatStreamChoice]:
        return [P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                for i in range(n)]

    def choice(self, index: int, out, k: int | None, offset: int = 0, stream: bool = False):
        lps = P.ChatLogprobs.of(out, k)
        if stream:
            return P.ChatStreamChoice(index=index, delta=P.DeltaMessage(content=out.text),
                                      logprobs=lps, finish_reason=out.finish_reason)
        return P.ChatChoice(index=index, message=P.DeltaMessage(role="assistant", content=out.text),
                            logprobs=lps, finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason)
