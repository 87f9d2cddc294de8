"""Residual add + RMSNorm: `reference` (plain jnp) and `triton_pallas` (one Pallas launch)."""
