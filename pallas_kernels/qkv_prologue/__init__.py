"""Fused attention prologue of one decoder layer (q/k RMSNorm + RoPE + K/V page write): `reference`
(plain jnp) and `triton_pallas` (one Pallas launch)."""
