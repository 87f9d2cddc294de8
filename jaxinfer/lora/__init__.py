"""LoRA adapters, vLLM's interface (host side, no JAX): `request.LoRARequest`, PEFT adapter
directories read into numpy (`peft`). The device pool: `jaxinfer.runner.lora`; the batched
low-rank product: `jaxinfer.models.lora`; slots and LRU on the host: `jaxinfer.engine.lora`."""
