"""Admission rules of a request (host side, no JAX): its length against the model's and the
KV pool's (CASES.md C1). As vLLM's engine: a ``max_tokens`` beyond the room left in
``max_model_len`` is no error; the request generates until the context is full ("length"). The
server's vLLM 400 for it: `jaxinfer.serve.completions.check_context`."""


def check_admissible(n_prompt: int, params, max_model_len: int, block_manager) -> None:
    """Raise ValueError unless ``1 <= n_prompt < max_model_len`` (room for one output token) and
    the request's most tokens, ``min(n_prompt + max_tokens, max_model_len)`` (`SamplingParams`
    ``params``; max_tokens None: one token), fit the whole pool of ``block_manager``. The
    messages state the rule broken and the numbers."""
    tokens = f"{n_prompt} token{'s' if n_prompt != 1 else ''}"
    if n_prompt == 0:
        raise ValueError("prompt has 0 tokens; at least 1 required")
    if n_prompt >= max_model_len:
        raise ValueError(
            f"prompt has {tokens}, max_model_len={max_model_len}: no room "
            "for an output token (rule: prompt tokens < max_model_len)"
        )
    max_tokens = params.max_tokens or 1
    most = min(n_prompt + max_tokens, max_model_len)
    bm = block_manager
    need, usable = bm.pages_needed(most), bm.num_usable_pages
    if need > usable:
        raise ValueError(
            f"prompt has {tokens} and max_tokens={max_tokens}: needs {need} KV pages of "
            f"{bm.page_size} tokens ({most} tokens), but the whole KV pool has {usable} usable "
            f"page{'s' if usable != 1 else ''} "
            f"({usable * bm.page_size} tokens); lower max_tokens or enlarge the pool"
        )
