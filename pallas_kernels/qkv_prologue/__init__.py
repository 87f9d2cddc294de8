"""The attention prologue in plain jnp (`reference`): q/k RMSNorm, RoPE, the K/V page write."""
