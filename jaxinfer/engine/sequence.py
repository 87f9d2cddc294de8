"""One request's host-side state (imports no JAX). Source: nano-vllm / vLLM ``Sequence``."""

import enum
import time
from dataclasses import dataclass, field

from jaxinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """WAITING: queued, no pages (new or preempted); RUNNING: holds pages; FINISHED: no pages."""

    WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request (identity-compared; ``index`` 0..n-1 of ``parent_id``).
    num_computed_tokens: K/V written or in flight; num_cached_tokens: prefix-cache hits at
    admission; num_pending_tokens: sampled, not read back (0-2); logprobs: per output token {id:
    (logprob, rank)} (None: not asked); prompt_logprobs: per prompt position (first None);
    matcher, rules: a constrained sample's grammar, `StructuredOutputManager.token_rules` (kept
    on preemption, as the outputs are)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list, kw_only=True)
    status: SequenceStatus = field(default=SequenceStatus.WAITING, kw_only=True)
    block_table: list[int] = field(default_factory=list, kw_only=True)
    num_computed_tokens: int = field(default=0, kw_only=True)
    num_pending_tokens: int = field(default=0, kw_only=True)
    finish_reason: str | None = field(default=None, kw_only=True)
    arrival_time: float = field(default_factory=time.perf_counter, kw_only=True)
    first_token_time: float | None = field(default=None, kw_only=True)
    finish_time: float | None = field(default=None, kw_only=True)
    num_preemptions: int = field(default=0, kw_only=True)
    num_passed_over: int = field(default=0, kw_only=True)  # admissions that overtook it
    stop_string: str | None = field(default=None, kw_only=True)
    index: int = field(default=0, kw_only=True)
    parent_id: str | None = field(default=None, kw_only=True)
    max_tokens: int | None = field(default=None, kw_only=True)
    num_cached_tokens: int = field(default=0, kw_only=True)
    lora_int_id: int = field(default=0, kw_only=True)  # its LoRARequest's id (0: none)
    lora_request: object = field(default=None, kw_only=True)  # that LoRARequest, for the outputs
    lora_slot: int = field(default=-1, kw_only=True)  # that adapter's pool slot while unfinished
    block_hashes: list = field(default_factory=list, kw_only=True)
    logprobs: list | None = field(default=None, kw_only=True)
    prompt_logprobs: list | None = field(default=None, kw_only=True)
    cumulative_logprob: float | None = field(default=None, kw_only=True)
    matcher: object = field(default=None, kw_only=True)
    rules: tuple | None = field(default=None, kw_only=True)
    decoded: tuple = field(
        default=(0, "", None), kw_only=True
    )  # `OutputProcessor`'s (m, text, params)

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise ValueError(
                f"Sequence.params={self.params!r} is invalid: must be a SamplingParams"
            )
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.output_token_ids = [int(t) for t in self.output_token_ids]
        self.seed = int(self.seed)
        self.parent_id = self.request_id if self.parent_id is None else self.parent_id
        if self.max_tokens is None:
            if self.params.max_tokens is None:
                raise ValueError("Sequence.max_tokens is needed when params.max_tokens is None")
            self.max_tokens = self.params.max_tokens
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    all_token_ids = property(lambda self: self.prompt_token_ids + self.output_token_ids)
    num_tokens = property(lambda self: len(self.prompt_token_ids) + len(self.output_token_ids))
    num_tokens_with_pending = property(lambda self: self.num_tokens + self.num_pending_tokens)
    num_prompt_tokens = property(lambda self: len(self.prompt_token_ids))
    num_output_tokens = property(lambda self: len(self.output_token_ids))
    last_token_id = property(lambda self: (self.output_token_ids or self.prompt_token_ids)[-1])
    is_finished = property(lambda self: self.status is SequenceStatus.FINISHED)

    def token_ids(self, lo: int, hi: int) -> list[int]:
        """``all_token_ids[lo:hi]`` (0 <= lo <= hi), without joining the prompt and outputs."""
        k = len(self.prompt_token_ids)
        if hi <= k:
            return self.prompt_token_ids[lo:hi]
        if lo >= k:
            return self.output_token_ids[lo - k : hi - k]
        return self.prompt_token_ids[lo:] + self.output_token_ids[: hi - k]

    ended_on_stop_token = property(
        lambda self: (
            self.is_finished
            and self.finish_reason == "stop"
            and self.stop_string is None
            and any(t in self.params.stop_token_ids for t in self.output_token_ids[-1:])
        ),
        doc="Finished on one of ``params.stop_token_ids`` (its text is left out).",
    )

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, pending="
            f"{self.num_pending_tokens}, pages={self.block_table}, {self.finish_reason!r})"
        )
