"""The tiny models of the tensor-parallel tests (test_tensor_parallel.py,
test_tensor_parallel_layout.py): float32 Qwen3 (untied, V=256: vocabulary split at tp 2 and 4)
and Llama (tied, V=250: vocabulary split at tp 2, replicated at tp 4), 8 query and 2 KV heads
(`CONFIGS`, `ModelConfig` keyword arguments); `FP8_CFG` for fp8 weights at tp 1 and 3,
`FP8_KV_CFG` for the fp8 KV cache; the `PROMPTS` and `ENGINE` arguments of every engine of
test_tensor_parallel.py; `SPLIT`, the leaves split at every tp."""

SPLIT = ("wqkv", "wo", "w_gate_up", "w_down")  # always split; embed / lm_head when tp divides V

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
CONFIGS = {
    "qwen3": dict(architecture="qwen3", vocab_size=256, **SMALL),
    "llama": dict(architecture="llama", vocab_size=250, tie_word_embeddings=True, **SMALL),
}
# fp8 weights (per-output-channel scales) at tp 1 and 3: one layer of 6 query heads and 1 KV head
# (a copy on each of 3 devices)
FP8_CFG = dict(
    architecture="llama",
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    num_layers=1,
    num_heads=6,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=128,
)
# the fp8 KV cache at tp 1, 2 and 4 (each device a copy of one KV head): one Llama layer
FP8_KV_CFG = dict(CONFIGS["llama"], num_layers=1)
PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 32],
    [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 28, 74, 71, 35, 26, 62, 49, 77],
]
ENGINE = dict(
    max_model_len=64,
    max_num_seqs=4,
    num_pages=24,
    max_num_batched_tokens=32,
    kernels="batch_buckets=2:4,token_buckets=32",
)
