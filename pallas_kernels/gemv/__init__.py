"""Matrix-vector product of a few rows (decode at batch 1-4): ``y [M, N] = x [M, K] @ w [K, N]``.

`reference.py` is the plain-jnp oracle; `triton_pallas.py` a Pallas kernel (Triton lowering) in
which each program owns a block of output columns and reads its [K, bn] strip of ``w`` once,
writing ``y`` in the output dtype directly (no reduction launch), or, split over K, float32
partial sums for a consumer kernel to add. Experimental: not used by the engine (BENCHMARKS.md).
"""
