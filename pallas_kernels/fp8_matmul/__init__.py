"""fp8-weight GEMM: `reference` (plain jnp) and `triton_pallas` (GEMV and tiled-dot paths)."""
