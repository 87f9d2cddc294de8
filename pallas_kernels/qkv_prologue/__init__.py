"""Fused attention prologue: `reference` (plain jnp) and `triton_pallas` (one Pallas launch)."""
