"""`LoRARequest`, vLLM's ``vllm.lora.request.LoRARequest`` (no JAX)."""

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM's: ``lora_name`` (its name, e.g. the served model
    name), ``lora_int_id`` (its identity, an int >= 1: one id, one adapter's weights) and
    ``lora_path`` (a PEFT directory: ``adapter_config.json`` + ``adapter_model.safetensors``).
    ValueError: a name that is no non-empty str, an id < 1, a path that is no str."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} must be a non-empty str")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an int >= 1")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be >= 1")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} must be a path")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    adapter_id = property(lambda self: self.lora_int_id, doc="vLLM's alias of lora_int_id.")
    name = property(lambda self: self.lora_name, doc="vLLM's alias of lora_name.")
    path = property(lambda self: self.lora_path, doc="vLLM's alias of lora_path.")


def per_prompt(lora_request, n: int) -> list:
    """``lora_request`` (None, one `LoRARequest` for all ``n`` prompts, or a list of one per
    prompt, None entries allowed) as a list of ``n``. ValueError: a list of another length, an
    entry that is no `LoRARequest` or None."""
    reqs = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(reqs) != n:
        raise ValueError(
            f"lora_request: {len(reqs)} requests for {n} prompts; give one, or one per prompt"
        )
    if bad := [r for r in reqs if r is not None and not isinstance(r, LoRARequest)]:
        raise ValueError(f"lora_request entry {bad[0]!r} is invalid: a LoRARequest or None")
    return reqs
