"""Engine counters (host side, no JAX), never read by the engine itself."""

import dataclasses
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """num_lazy_compiles: programs compiled in a step (compile_s: their seconds, lowering
    included); num_overlapped_steps: dispatched with one in flight; forward_shapes,
    sampler_shapes, prompt_shapes: the keys compiled so far of the step's three programs
    (`jaxinfer.step_input`); prefix_cache_queries / _hits: admitted tokens looked up / found;
    queue and pool sizes: filled in by `LLMEngine.stats`. Speculative decoding (vLLM's
    ``SpecDecodingStats``): spec_num_drafts: rows verified with >= 1 draft token;
    spec_num_draft_tokens / spec_num_accepted_tokens: draft tokens verified / accepted;
    spec_accepted_per_pos[i]: drafts whose token at position i (0..k-1) was accepted (a draft
    accepted up to position j counts at 0..j); the engine sizes it to k when speculation is
    configured (`accepted_per_pos` pads it)."""

    num_steps: int = 0
    num_lazy_compiles: int = 0
    compile_s: float = 0.0
    num_overlapped_steps: int = 0
    max_kv_len_seen: int = 0
    forward_shapes: set = field(default_factory=set)
    sampler_shapes: set = field(default_factory=set)
    prompt_shapes: set = field(default_factory=set)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_pages_in_use: int = 0
    kv_pages_total: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    prefix_cache_hit_rate = property(
        lambda self: self.prefix_cache_hits / max(self.prefix_cache_queries, 1),
        doc="Hit tokens / queried tokens (0.0 before any query).",
    )
    compiled_shapes = property(
        lambda self: {
            (program, key)
            for program in ("forward", "sampler", "prompt")
            for key in getattr(self, program + "_shapes")
        },
        doc="Every compiled (program, key).",
    )
    num_compiles = property(lambda self: len(self.compiled_shapes))
    spec_mean_acceptance_length = property(
        lambda self: (
            1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts
            if self.spec_num_drafts
            else 1.0
        ),
        doc="1 + accepted / drafts: tokens a verified row gains per step, its own one included "
        "(vLLM's mean acceptance length); 1.0 before any draft, as vLLM's "
        "compute_acceptance_len.",
    )

    def accepted_per_pos(self, k: int) -> list[int]:
        """`spec_accepted_per_pos` padded with zeros to ``k`` positions (a longer list whole)."""
        per_pos = list(self.spec_accepted_per_pos)
        return per_pos + [0] * (k - len(per_pos))

    def copy(self) -> "EngineStats":
        """A copy whose shape sets and per-position list are the copy's own."""
        return dataclasses.replace(
            self,
            **{
                f: set(getattr(self, f))
                for f in ("forward_shapes", "sampler_shapes", "prompt_shapes")
            },
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
        )
