"""`engine_config`: `LLM`'s keyword arguments, vLLM's names included, -> `EngineConfig`; the
vLLM arguments that are no `EngineConfig` field (`VLLM_ALIASES`, `VLLM_ONLY`, `VLLM_NO_EFFECT`;
`VLLM_HUB`: `LLM`'s own).
No JAX."""

import logging

from jaxinfer.config.engine import EngineConfig

# vLLM `LLM` arguments that are not `EngineConfig` fields, as `engine_config` reads them
VLLM_ALIASES = {"block_size": "page_size", "num_gpu_blocks_override": "num_pages"}
VLLM_ONLY = {  # name: (the values allowed, why no other)
    **{
        k: (("auto", "generate"), "jaxinfer runs generative models only (no pooling)")
        for k in ("task", "runner")
    },
    "pipeline_parallel_size": ((1,), "one pipeline stage (tensor_parallel_size splits a model)"),
    "load_format": (("auto", "safetensors", "gguf"), "the format is read from the model path"),
    "logits_processors": (
        (None, []),
        "vLLM V1's logits-processor classes are not supported; give"
        " SamplingParams(logits_processors=[JAX fn(output_token_ids, logits)])",
    ),
}
VLLM_NO_EFFECT = {  # name: (values that mean vLLM's default, why any other value changes nothing)
    "trust_remote_code": ((False,), "no model code is loaded (the architectures are built in)"),
    "swap_space": ((4,), "preempted requests are recomputed, never swapped to host memory"),
    "disable_log_stats": ((True,), "LLM logs no statistics (LLM.get_metrics() returns them)"),
    "enable_chunked_prefill": ((None, True), "prompts over max_num_batched_tokens are chunked"),
    "compilation_config": ((None, {}), "each step shape is compiled by XLA (jax.jit)"),
    "tokenizer_mode": (("auto", "hf"), "the checkpoint's HF tokenizer is used"),
    "max_cpu_loras": ((None,), "every LoRA adapter read stays in host memory (no host LRU)"),
}
# vLLM `LLM` arguments `LLM` itself reads (no `EngineConfig` field): a model or tokenizer that is a
# hub id is fetched with them (`checkpoints_tools.hub.resolve_path`)
VLLM_HUB = ("revision", "tokenizer_revision", "download_dir", "hf_token")


def engine_config(**args) -> EngineConfig:
    """The `EngineConfig` of `LLM`'s keyword arguments: its fields and the `VLLM_*` tables' (a
    `VLLM_NO_EFFECT` value other than vLLM's default: one warning line). ValueError: an unknown
    argument (the allowed ones named), a value not allowed, an alias disagreeing with its field."""
    known = {*EngineConfig.__dataclass_fields__, *VLLM_ALIASES, *VLLM_ONLY, *VLLM_NO_EFFECT}
    if unknown := sorted(set(args) - known):
        raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
    for alias, name in VLLM_ALIASES.items():
        if alias in args and args.setdefault(name, args[alias]) != args.pop(alias):
            raise ValueError(f"{alias} (vLLM's name of {name}) and {name} differ: give one")
    for name, (allowed, why) in VLLM_ONLY.items():
        if (v := args.pop(name, allowed[0])) not in allowed:
            raise ValueError(
                f"{name}={v!r} is invalid: {why}; allowed: " + ", ".join(map(repr, allowed))
            )
    for name, (silent, why) in VLLM_NO_EFFECT.items():
        if name in args and (v := args.pop(name)) not in silent:
            logging.getLogger("jaxinfer").warning("jaxinfer: %s=%r has no effect: %s", name, v, why)
    return EngineConfig(**args)
