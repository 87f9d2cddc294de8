"""Results returned by `LLM.generate`, named and shaped as vLLM's (host side, no JAX)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timing, in seconds of ``time.perf_counter`` (host clock).

    ttft_s: time to first token (arrival -> first sampled token).
    decode_tokens_per_s: generated tokens after the first, per second of decoding (0 if < 2 tokens).
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def decode_tokens_per_s(self, num_output_tokens: int) -> float:
        if self.first_token_time is None or self.finish_time is None or num_output_tokens < 2:
            return 0.0
        dt = self.finish_time - self.first_token_time
        return (num_output_tokens - 1) / dt if dt > 0 else 0.0


@dataclass(frozen=True)
class CompletionOutput:
    """One completion: ``finish_reason`` is "stop" (EOS, stop token or stop string), "length"
    (max_tokens or max_model_len reached) or "error" (rejected before scheduling: see ``error``).

    ``stop_reason`` (vLLM's rule): the stop string or the stop token id that ended it, None
    otherwise (EOS included). ``text`` leaves out the stop string and the stop token's text;
    ``token_ids`` keep the stop token."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The result of one request, in the order the prompts were given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)

    @property
    def text(self) -> str:
        """Text of the first completion (convenience)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Token ids of the first completion (convenience)."""
        return self.outputs[0].token_ids if self.outputs else ()
