"""``POST /v1/completions`` (vLLM's ``serving_completion.py``): a prompt, a list of prompts,
token ids or lists of them; ``n`` samples each, choice ``i * n + j`` for sample j of prompt i."""

from __future__ import annotations

from fastapi import Request

from jaxinfer.serve import protocol as P
from jaxinfer.serve.errors import APIError
from jaxinfer.serve.openai_logprobs import completion_logprobs
from jaxinfer.serve.serving import OpenAIServing


class ServingCompletion(OpenAIServing):
    prefix, Response, Chunk = "cmpl", P.CompletionResponse, P.CompletionResponse

    async def create(self, body: P.CompletionRequest, request: Request):
        for field, bad in (("echo", body.echo), ("suffix", body.suffix is not None),
                           ("best_of", body.best_of not in (None, body.n))):
            if bad:
                raise APIError(f"{field} is not supported", param=field)
        sp = self.sampling_params(body, body.max_tokens, body.logprobs)
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        prompts = [await self.prompt_ids(lambda x=x: self.llm._to_ids(x)[1], sp, "prompt")
                   for x in p]
        return await self.respond(request, body, prompts, sp)

    def choice(self, index: int, out, k: int | None, offset: int = 0, stream: bool = False):
        lps = None if k is None or out.logprobs is None else completion_logprobs(
            out.token_ids, out.logprobs, k, offset)
        return P.CompletionChoice(index=index, text=out.text, logprobs=lps,
                                  finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason)
