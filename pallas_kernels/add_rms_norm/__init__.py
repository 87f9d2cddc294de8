"""Residual add + RMSNorm (``x += delta; h = rms_norm(x)``): `reference` (plain jnp) and
`triton_pallas` (one Pallas launch)."""
