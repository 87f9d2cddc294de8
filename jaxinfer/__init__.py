"""jaxinfer: JAX/Pallas LLM inference (pure-function models, paged KV cache, continuous batching).
The public API (vLLM names) loads lazily, so host-side modules do not pull in JAX."""

import importlib

_WHERE = {
    "LLM": "jaxinfer.llm",
    "SamplingParams": "jaxinfer.sampling_params",
    "RequestOutput": "jaxinfer.outputs",
    "CompletionOutput": "jaxinfer.outputs",
    "EngineConfig": "jaxinfer.config",
    "KernelConfig": "jaxinfer.config",
    "ModelConfig": "jaxinfer.config",
    "StructuredOutputsParams": "jaxinfer.sampling_params",
    "BeamSearchParams": "jaxinfer.sampling_params",
    "TextPrompt": "jaxinfer.inputs",
    "TokensPrompt": "jaxinfer.inputs",
    "LoRARequest": "jaxinfer.lora.request",
}
__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
