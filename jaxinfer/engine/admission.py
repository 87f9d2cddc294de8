"""Admission rules of a request (host side, no JAX): its length against the model's and the
KV pool's (CASES.md C1)."""


def check_admissible(n_prompt: int, params, max_model_len: int, block_manager) -> None:
    """Raise ValueError unless ``1 <= n_prompt`` and ``n_prompt + max_tokens`` (`SamplingParams`
    ``params``) fits ``max_model_len`` and the whole pool of ``block_manager`` (max_tokens
    None: one token must fit). The messages state the rule broken and the numbers."""
    tokens = f"{n_prompt} token{'s' if n_prompt != 1 else ''}"
    if n_prompt == 0:
        raise ValueError("prompt has 0 tokens; at least 1 required")
    if params.max_tokens is None and n_prompt >= max_model_len:
        raise ValueError(
            f"prompt has {tokens}, max_model_len={max_model_len}: no room "
            "for an output token (rule: prompt tokens < max_model_len)"
        )
    max_tokens = params.max_tokens or 1
    if n_prompt + max_tokens > max_model_len:
        raise ValueError(
            f"prompt has {tokens} and max_tokens={max_tokens}: prompt + max_tokens = "
            f"{n_prompt + max_tokens} exceeds max_model_len={max_model_len} (rule: prompt "
            f"tokens + max_tokens <= max_model_len)"
        )
    bm = block_manager
    need, usable = bm.pages_needed(n_prompt + max_tokens), bm.num_usable_pages
    if need > usable:
        raise ValueError(
            f"prompt has {tokens} and max_tokens={max_tokens}: needs {need} KV pages "
            f"of {bm.page_size} tokens, but the whole KV pool has {usable} usable "
            f"page{'s' if usable != 1 else ''} "
            f"({usable * bm.page_size} tokens); lower max_tokens or enlarge the pool"
        )
