"""Engine counters (host side, no JAX), never read by the engine itself."""

import dataclasses
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """num_lazy_compiles: programs compiled in a step (compile_s: their seconds, lowering
    included); num_overlapped_steps: dispatched with one in flight; forward_shapes,
    sampler_shapes, prompt_shapes: the keys compiled so far of the step's three programs
    (`jaxinfer.step_input`); prefix_cache_queries / _hits: admitted tokens looked up / found;
    queue and pool sizes: filled in by `LLMEngine.stats`."""

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

    def copy(self) -> "EngineStats":
        """A copy whose shape sets are the copy's own."""
        return dataclasses.replace(
            self,
            **{
                f: set(getattr(self, f))
                for f in ("forward_shapes", "sampler_shapes", "prompt_shapes")
            },
        )
